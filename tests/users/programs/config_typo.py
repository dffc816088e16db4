"""A British spelling of a config key."""

from hybridmem import HybridConfig

HybridConfig(offload_train_optimiser=True)
print("accepted")
