"""Adapters that wrap third-party training and inference frameworks in hybridmem's protocols.

Import the adapter module itself, e.g. ``from hybridmem.adapters.vllm import VLLMEngine`` or
``from hybridmem.adapters.megatron import MegatronTrainingState``; ``import hybridmem`` never imports
vLLM or Megatron-core. The vLLM adapter imports vLLM only when an engine is created; the Megatron
adapter imports megatron-core when its module is imported.
"""
