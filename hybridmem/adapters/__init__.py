"""Adapters that wrap third-party training and inference frameworks in hybridmem's protocols.

Each adapter imports its framework lazily (only when it is used), so ``import hybridmem`` never
imports vLLM or Megatron. Import the adapter module itself, e.g.
``from hybridmem.adapters.vllm import VLLMEngine``.
"""
