"""Each transform once: build_local equals a torch expression, scatter_local inverts it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmem.reshard.transforms import (
    block,
    build_local,
    concat,
    pad_rows,
    replicate,
    scatter_local,
    split,
    stack,
)


def _full():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(12, 6, generator=g), "b": torch.randn(12, 6, generator=g),
            "n": torch.randn(6, generator=g)}


def _roundtrip(local, full, names):
    back = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    scatter_local(local, build_local(local, full), back)
    for k in names:
        assert torch.equal(back[k], full[k])


def test_replicate():
    full = _full()
    local = replicate("n", (6,))
    assert torch.equal(build_local(local, full), full["n"])


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("num", [1, 2, 3, 6])
def test_split(axis, num):
    full = _full()
    parts = [split("a", (12, 6), axis=axis, rank=r, num=num) for r in range(num)]
    for r, local in enumerate(parts):
        assert torch.equal(build_local(local, full), full["a"].chunk(num, axis)[r])
    back = {"a": torch.zeros(12, 6)}
    for _, local in enumerate(parts):
        scatter_local(local, build_local(local, full), back)
    assert torch.equal(back["a"], full["a"])


def test_split_not_divisible_names_numbers():
    with pytest.raises(ValueError, match="a dim 1=6 is not divisible by 4"):
        split("a", (12, 6), axis=1, rank=0, num=4)


def test_concat_gate_up_halves_and_groups():
    full = _full()
    local = concat([split("a", (12, 6), axis=0, rank=1, num=2), split("b", (12, 6), axis=0, rank=1, num=2)])
    assert torch.equal(build_local(local, full), torch.cat([full["a"][6:], full["b"][6:]]))
    # Interleave per group: [a rows 0-3; b rows 0-1; a rows 4-7; b rows 2-3]
    local = concat([block("a", (12, 6), 0, 4), block("b", (12, 6), 0, 2), block("a", (12, 6), 4, 8),
                    block("b", (12, 6), 2, 4)])
    ref = torch.cat([full["a"][0:4], full["b"][0:2], full["a"][4:8], full["b"][2:4]])
    assert torch.equal(build_local(local, full), ref)


@pytest.mark.parametrize("num", [1, 2, 4])
def test_pad_rows(num):
    full = _full()
    parts = [pad_rows("a", (12, 6), padded_rows=16, rank=r, num=num) for r in range(num)]
    ref = F.pad(full["a"], (0, 0, 0, 4)).chunk(num)
    for r, local in enumerate(parts):
        assert torch.equal(build_local(local, full), ref[r])
    _roundtrip(concat(parts) if num > 1 else parts[0], full, ["a"])


def test_stack_experts():
    full = _full()
    local = stack([concat([split("a", (12, 6), axis=0, rank=0, num=2),
                           split("b", (12, 6), axis=0, rank=0, num=2)]),
                   concat([split("b", (12, 6), axis=0, rank=0, num=2),
                           split("a", (12, 6), axis=0, rank=0, num=2)])])
    got = build_local(local, full)
    assert got.shape == (2, 12, 6)
    assert torch.equal(got[0], torch.cat([full["a"][:6], full["b"][:6]]))
    assert torch.equal(got[1], torch.cat([full["b"][:6], full["a"][:6]]))
    back = {k: torch.zeros_like(v) for k, v in full.items()}
    scatter_local(local, got, back)
    assert torch.equal(back["a"][:6], full["a"][:6]) and torch.equal(back["b"][:6], full["b"][:6])
    assert not back["a"][6:].any()


def test_an_all_padding_shard_takes_its_dtype_from_the_argument_or_full():
    local = pad_rows("a", (5, 3), padded_rows=16, rank=3, num=4)  # rows 12..15: all padding
    assert local.pieces == ()
    assert torch.equal(build_local(local, {}, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16))
    assert build_local(local, {"a": torch.ones(5, 3, dtype=torch.float16)}).dtype == torch.float16
    with pytest.raises(ValueError, match="all padding"):
        build_local(local, {})
