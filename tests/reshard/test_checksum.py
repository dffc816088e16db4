"""The weight-sync checksum tells a fused weight whose rows were exchanged from the right one.

A wrong interleave of a fused ``qkv_proj`` / ``gate_up_proj`` (rows of q, k and v, or of gate and up, put
in each other's places) moves no value in or out of a slice, so the plain sum of every slice is
unchanged; only the position-weighted sum (row weights ``u(row)`` in ``u @ X @ v``) sees it.
"""

from __future__ import annotations

import re

import pytest
import torch

from hybridmem import HybridConfig, Phase, ShardingManager, WeightSyncError
from hybridmem.engines import ENGINE_TAGS, ReferenceEngine
from hybridmem.engines.nn.config import hf_config_dict
from hybridmem.engines.nn.gpt import MegatronLayoutGPT, init_hf_weights
from hybridmem.reshard import megatron_layout, shard
from hybridmem.reshard.checksum import box_checksum
from hybridmem.reshard.spec import ModelSpec

CFG = ModelSpec(family="qwen2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=48, num_hidden_layers=2, vocab_size=50, qkv_bias=True,
                    rms_norm_eps=1e-6, rope_theta=10000.0)


def _swap_rows(t: torch.Tensor, i: int, j: int) -> None:
    with torch.no_grad():
        t[[i, j]] = t[[j, i]]


def test_box_checksum_weights_rows():
    # Whole numbers: the plain sums of the two tensors are then equal to the last bit.
    x = torch.randint(-50, 50, (24, 16), generator=torch.Generator().manual_seed(0)).to(torch.float32)
    swapped = x.clone()
    _swap_rows(swapped, 3, 17)
    box = ((8, 32), (0, 16))  # a slice of an HF-full tensor starting at row 8
    total, weighted = box_checksum(x, box)
    swapped_total, swapped_weighted = box_checksum(swapped, box)
    assert swapped_total == total, "a row swap moves no value: the plain sums agree"
    assert swapped_weighted != pytest.approx(weighted, rel=1e-9), "the weighted sum must see the swap"


def _megatron_layout_model() -> MegatronLayoutGPT:
    spec = CFG
    full = init_hf_weights(CFG, seed=3, dtype=torch.float32)
    local = shard(full, megatron_layout(spec, HybridConfig().train_layout, 1), 0)
    model = MegatronLayoutGPT(CFG, padded_vocab_size=local["embedding.word_embeddings.weight"].shape[0],
                              group=None, dtype=torch.float32, device="cpu")
    model.load_state_dict(local)
    return model


@pytest.mark.parametrize(("name", "hf_name"), [
    ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_proj.weight"),
])
def test_sync_that_exchanges_two_rows_of_a_fused_weight_fails_verification(monkeypatch, name, hf_name):
    """A resharding executor that writes two rows of a fused engine weight in each other's places (both
    inside the q rows, or the gate rows, so no value leaves its slice) is caught by the manager's
    ``verify_weight_sync``, and the switch rolls back."""
    import hybridmem.weight_sync.resharding as reshard_sync  # the module whose executor is wrapped

    real_run_plan = reshard_sync.run_plan

    def run_plan_exchanging_rows(*args, **kwargs):
        dst, stats = real_run_plan(*args, **kwargs)
        assert not torch.equal(dst[name][0], dst[name][1]), "rows to exchange must differ"
        _swap_rows(dst[name], 0, 1)
        return dst, stats

    model = _megatron_layout_model()
    engine = ReferenceEngine(hf_config_dict(CFG), num_kv_blocks=8, block_size=8)
    engine.release(list(ENGINE_TAGS))
    config = HybridConfig(device="cpu", verify_weight_sync=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ShardingManager(model, engine, optimizer=opt, config=config, model_spec=hf_config_dict(CFG))
    try:
        with manager.inference():  # the right sync passes verification
            pass
        monkeypatch.setattr(reshard_sync, "run_plan", run_plan_exchanging_rows)
        with pytest.raises(WeightSyncError, match=re.escape(f"{hf_name} slice")) as info:
            manager.to_infer()
        assert f"into {name}" in str(info.value), str(info.value)
        assert manager.phase is Phase.TRAIN
    finally:
        monkeypatch.undo()
        if manager.phase is Phase.INFER:  # the corruption went unseen: leave INFER so close() can run
            manager.to_train()
        manager.close()
