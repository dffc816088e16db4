"""A persistent buffer that vLLM's loader fills (Gemma 4's ``layer_scalar``) is a weight of the name check and
of the in-place sync; vLLM's own buffers (an attention layer's scales) and non-persistent ones are neither.

The module is a plain torch stand-in for a vLLM model: what counts as persistent is torch's ``state_dict``."""

from __future__ import annotations

import pytest
import torch

from hybridmem.adapters.vllm.names import check_weight_names
from hybridmem.adapters.vllm.worker import WorkerInfo, persistent_buffers


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("_k_scale", torch.tensor(1.0))
        self.register_buffer("cos_sin_cache", torch.zeros(3), persistent=False)


def _info(model: torch.nn.Module) -> WorkerInfo:
    return WorkerInfo(rank=0, has_reload_weights=True,
                      params=tuple((n, tuple(p.shape)) for n, p in model.named_parameters()),
                      buffers=tuple((n, tuple(b.shape)) for n, b in persistent_buffers(model)))


def test_persistent_buffers_are_those_of_the_state_dict():
    model = torch.nn.Sequential(_Layer(), _Layer())
    names = [n for n, _ in persistent_buffers(model)]
    assert names == [n for n in model.state_dict() if n in dict(model.named_buffers())]
    assert names == ["0.layer_scalar", "0._k_scale", "1.layer_scalar", "1._k_scale"]


def test_a_buffer_the_layout_names_is_checked_like_a_parameter():
    info = _info(torch.nn.Sequential(_Layer()))
    check_weight_names(info, {"0.proj.weight": (4, 4), "0.layer_scalar": (1,)}, what="the layout")
    # Not named by the layout: vLLM's own buffer, no part of the check.
    check_weight_names(info, {"0.proj.weight": (4, 4)}, what="the layout")
    with pytest.raises(ValueError, match=r"1 shapes differ: \['0.layer_scalar: vLLM \(1,\) vs \(2,\)'\]"):
        check_weight_names(info, {"0.proj.weight": (4, 4), "0.layer_scalar": (2,)}, what="the layout")
    with pytest.raises(ValueError, match=r"the sync writes are not vLLM parameters: \['0.cos_sin_cache'\]"):
        check_weight_names(info, {"0.proj.weight": (4, 4), "0.cos_sin_cache": (3,)}, what="the layout")
