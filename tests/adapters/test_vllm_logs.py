"""The filter for vLLM's reload warning ([Note: vllm buffer-only reload warning] in
:mod:`hybridmem.adapters.vllm.inprocess.logs`): which module classes it covers, and that it drops exactly
that message for them, only while the adapter's reload runs."""

from __future__ import annotations

import logging

import torch

from hybridmem.adapters.vllm.inprocess.logs import (
    FAILED_TO_LOAD,
    LAYERWISE_LOGGER,
    quiet_buffer_only_reload,
)
from hybridmem.adapters.vllm.worker import buffer_only_classes


class RotaryEmbedding(torch.nn.Module):  # vLLM's: a cache computed from the config, outside the state dict
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4, 2), persistent=False)


class Scales(torch.nn.Module):  # buffers a checkpoint holds (persistent)
    def __init__(self):
        super().__init__()
        self.register_buffer("k_scale", torch.ones(1))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary_emb = RotaryEmbedding()
        self.scales = Scales()
        self.norm = torch.nn.LayerNorm(2)


def test_only_classes_with_non_persistent_buffers_and_no_parameters_count():
    model = torch.nn.Sequential(Block(), Block())
    assert buffer_only_classes(model) == ("RotaryEmbedding",)
    # One module of a class with a parameter takes the whole class out.
    model[1].rotary_emb.extra = torch.nn.Parameter(torch.zeros(1))
    assert buffer_only_classes(model) == ()


def test_the_filter_drops_that_message_for_those_classes_only_inside_the_block(caplog):
    logger = logging.getLogger(LAYERWISE_LOGGER)
    caplog.set_level(logging.WARNING, logger=LAYERWISE_LOGGER)
    with quiet_buffer_only_reload(["RotaryEmbedding"]) as quiet:
        logger.warning(FAILED_TO_LOAD, "RotaryEmbedding")
        logger.warning(FAILED_TO_LOAD, "RMSNorm")  # a module with parameters got nothing: still reported
        logger.warning("%s: Excessive loading", "RotaryEmbedding")  # another message: still reported
    logger.warning(FAILED_TO_LOAD, "RotaryEmbedding")  # outside the adapter's reload: untouched
    assert [r.getMessage() for r in caplog.records] == [
        "RMSNorm: Failed to load weights", "RotaryEmbedding: Excessive loading",
        "RotaryEmbedding: Failed to load weights"]
    assert quiet.dropped == ["RotaryEmbedding"]
    assert quiet not in logger.filters
