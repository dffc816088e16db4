"""Test support that ships with the package (never imported by library code paths).

- :mod:`hybridmem.testing.workers`: a reusable pool of processes joined in a gloo group, so
  distributed tests do not pay process start-up per test.
- :mod:`hybridmem.testing.megatron_cpu`: ``megatron_on_cpu()``, run megatron-core on a machine without
  CUDA (patches torch.cuda and tensor factories inside a ``with`` block; tests and demos only).
- :mod:`hybridmem.testing.megatron_models`: tiny DDP-wrapped Megatron GPT models and their optimizers.
"""
