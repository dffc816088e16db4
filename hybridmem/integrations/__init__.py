"""Integrations with RL trainers that drive hybridmem for their users.

Each submodule imports its trainer library when it is imported itself (``hybridmem.integrations.trl``:
Hugging Face TRL); importing ``hybridmem`` or this package imports none of them.
"""
