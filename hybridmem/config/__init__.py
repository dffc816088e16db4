"""Configuration: :class:`HybridConfig` with MindSpeed-RL's keys (:mod:`.hybrid`), the key tables of
MindSpeed-RL's releases (:mod:`.mindspeed`) and the command line's parser (:mod:`.arguments`)."""

from __future__ import annotations

from hybridmem.config.hybrid import (
    DEVICE_CHOICES,
    HybridConfig,
    LoraBase,
    ParallelLayout,
)

__all__ = ["ParallelLayout", "HybridConfig", "DEVICE_CHOICES", "LoraBase"]
