"""A hybridmem key written under a MindSpeed-RL section that does not take it: the error shows its value."""

from pathlib import Path

from hybridmem import HybridConfig

Path("job.yaml").write_text("actor_config:\n  tensor_model_parallel_size: 2\n"
                            "  infer_tensor_parallel_size: 4\n")
HybridConfig.from_yaml("job.yaml")
print("accepted")
