"""Uneven pipeline stages (see [Note: uneven stages] in :mod:`hybridmem.reshard.stages`).

References: megatron-core's own ``get_num_layers_to_build`` for Megatron's split, vLLM's own
``get_pp_indices`` (with and without ``VLLM_PP_LAYER_PARTITION``) for vLLM's, and weights whose every
layer is filled with its own index, so which layer a stage holds is read off the values.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import ParallelLayout
from hybridmem.reshard import (
    MegatronConvention,
    ModelSpec,
    VLLMConvention,
    build_plan,
    hf_layout,
    megatron_layout,
    megatron_stage_layers,
    reshard_offline,
    shard,
    unshard,
    vllm_layout,
    vllm_stage_layers,
)

LLAMA = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             intermediate_size=96, vocab_size=128, tie_word_embeddings=False)
DEEPSEEK_V3_SHAPE = dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=8,
                         num_key_value_heads=8, num_hidden_layers=61, intermediate_size=128, vocab_size=256,
                         n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
                         moe_intermediate_size=32, q_lora_rank=32,
                         kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         first_k_dense_replace=3, n_group=1, topk_group=1, topk_method="noaux_tc")


def _megatron_split(num_layers: int, pp: int, first, last) -> tuple[int, ...]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last)
    return tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(pp))


@pytest.mark.parametrize("num_layers,pp,first,last",
                         [(61, 4, 13, 16), (61, 8, 5, 8), (7, 2, 3, None), (10, 3, None, 2)])
def test_megatron_split_is_megatron_cores(num_layers, pp, first, last):
    pytest.importorskip("megatron.core")
    ours = megatron_stage_layers(num_layers, pp, first=first, last=last)
    assert ours == _megatron_split(num_layers, pp, first, last)


def test_a_megatron_split_that_does_not_divide_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"num_layers=61 with first=11, last=None does not split evenly over "
                                         r"the other 3"):
        megatron_stage_layers(61, 4, first=11)


@settings(max_examples=40, deadline=None)
@given(num_layers=st.integers(2, 70), pp=st.integers(1, 8), partition=st.booleans())
def test_vllm_split_is_vllms_get_pp_indices(monkeypatch_module, num_layers, pp, partition):
    pytest.importorskip("vllm")
    from vllm.distributed.utils import get_pp_indices

    if pp > num_layers:
        return
    text = None
    if partition:  # a partition of its own: the last stage gets what the others leave
        parts = [max(1, num_layers // pp - 1)] * (pp - 1)
        parts.append(num_layers - sum(parts))
        if parts[-1] < 1:
            return
        text = ",".join(map(str, parts))
    with monkeypatch_module.context() as m:
        if text is None:
            m.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        else:
            m.setenv("VLLM_PP_LAYER_PARTITION", text)
        theirs = tuple(get_pp_indices(num_layers, r, pp)[1] - get_pp_indices(num_layers, r, pp)[0]
                       for r in range(pp))
    assert vllm_stage_layers(num_layers, pp, text) == theirs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def _layer_filled(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every tensor of layer i holds i + 1; the rest holds -1."""
    out = {}
    for name, shape in spec.full_shapes().items():
        value = int(name.split(".")[2]) + 1 if name.startswith("model.layers.") else -1
        out[name] = torch.full(shape, float(value))
    return out


def test_uneven_megatron_stages_reshard_into_uneven_vllm_stages(monkeypatch):
    spec = ModelSpec.from_hf_config({**LLAMA, "num_hidden_layers": 7})
    full = _layer_filled(spec)
    train = ParallelLayout(tp=2, pp=2)
    src = megatron_layout(spec, train, 4, convention=MegatronConvention(stage_layers=(3, 4)))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "5,2")  # vLLM's engine would split so
    dst = vllm_layout(spec, ParallelLayout(tp=1, pp=2), 4)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert dst.convention.stage_layers == (5, 2)  # fixed when the layout was built
    # Megatron numbers layers from 0 on each stage: stage 1 (ranks 2, 3) holds global layers 3..6.
    stage1 = shard(full, src, 2)
    assert sorted({int(n.split(".")[2]) for n in stage1 if n.startswith("decoder.layers.")}) == [0, 1, 2, 3]
    assert all(stage1[f"decoder.layers.{i}.self_attention.linear_proj.weight"].eq(3 + i + 1).all()
               for i in range(4))
    infer = reshard_offline([shard(full, src, r) for r in range(4)], model=spec, src=train,
                            dst=ParallelLayout(tp=1, pp=2),
                            megatron=MegatronConvention(stage_layers=(3, 4)),
                            vllm=VLLMConvention(stage_layers=(5, 2)))
    for rank, tensors in enumerate(infer):
        stage = (rank // 1) % 2
        layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")})
        assert layers == ([0, 1, 2, 3, 4] if stage == 0 else [5, 6]), (rank, layers)
        for name, t in tensors.items():
            if name.startswith("model.layers."):
                assert t.eq(int(name.split(".")[2]) + 1).all(), (rank, name)
    assert all(torch.equal(unshard(infer, dst)[n], full[n]) for n in full)


def test_deepseek_v3_61_layers_plan_from_uneven_megatron_pp4():
    spec = ModelSpec.from_hf_config(DEEPSEEK_V3_SHAPE)
    stages = megatron_stage_layers(61, 4, first=13, last=16)
    src = megatron_layout(spec, ParallelLayout(tp=2, pp=4, ep=2), 16,
                          convention=MegatronConvention(stage_layers=stages))
    dst = vllm_layout(spec, ParallelLayout(tp=8, ep=16), 16, convention=VLLMConvention(stage_layers=(61,)))
    plan = build_plan(src, dst, itemsize=2)
    assert sum(plan.recv_nbytes(r) for r in range(16)) > 0
    assert {src.coords(r).layers[0] for r in range(16)} == {0, 13, 29, 45}
    with pytest.raises(ValueError, match=r"training pp=4 does not divide num_hidden_layers=61: give the "
                                         r"stages"):
        megatron_layout(spec, ParallelLayout(tp=2, pp=4, ep=2), 16)


def test_hf_stream_follows_the_engines_split(monkeypatch):
    spec = ModelSpec.from_hf_config({**LLAMA, "num_hidden_layers": 7})
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,5")
    layout = hf_layout(spec, ParallelLayout(pp=2), 2)
    assert layout.coords(0).layers == (0, 1) and layout.coords(1).layers == (2, 3, 4, 5, 6)
