"""``hybridmem plan --infer-dtype fp8``: an engine serving vLLM's block FP8 ([Note: fp8 sync] in
:mod:`hybridmem.weight_sync.fp8`), its weights and the sync's bytes counted by hand for a tiny Qwen3 (hidden
256, q 4x128, kv 2x128, MLP 512, 2 layers, vocab 256, untied); the same figures the switch reports
(tests/weight_sync/test_fp8_sync.py, tests/reshard/test_layout_stream.py)."""

from __future__ import annotations

import json

import pytest

from hybridmem.planner.command import main

FIELDS = ("hidden_size=256", "num_attention_heads=4", "num_key_value_heads=2", "head_dim=128",
          "intermediate_size=512", "num_hidden_layers=2", "vocab_size=256", "tie_word_embeddings=false")
QWEN3 = ["--family", "qwen3", *(x for kv in FIELDS for x in ("--set", kv))]


def _plan(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert main([*QWEN3, *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _layer(rows: int, cols: int, unquantized: int) -> int:
    """One layer of an FP8 engine holding ``rows`` of every column-parallel weight and ``cols`` columns of the
    row-parallel ones: e4m3 qkv [rows, 256], o [256, cols], gate_up [rows, 256], down [256, cols], one byte an
    element; float32 scales, four bytes a 128x128 block; four norms (256, 256, 128, 128) of ``unquantized``
    bytes an element."""
    weights = rows * 256 + 256 * cols + rows * 256 + 256 * cols
    blocks = (rows // 128) * 2 + 2 * (cols // 128) + (rows // 128) * 2 + 2 * (cols // 128)
    return weights + 4 * blocks + unquantized * (256 + 256 + 128 + 128)


@pytest.mark.parametrize("dtype,nbytes", [("bf16", 2), ("fp32", 4)])
def test_one_engine_holds_fp8_weights_with_scales_and_the_rest_in_the_param_dtype(tmp_path, dtype, nbytes):
    plan = _plan(tmp_path, "--world", "1", "--infer-dtype", "fp8", "--param-dtype", dtype)
    rank = plan["ranks"][0]
    # qkv 512 + 256 + 256 rows, gate_up 2 x 512; embedding, head [256, 256] and the final norm unquantized
    want = 2 * _layer(1024, 512, nbytes) + (2 * 256 * 256 + 256) * nbytes
    assert rank["state_nbytes"]["engine_weights"] == want == {2: 1_838_976, 4: 2_104_704}[nbytes]


# The weight elements of the tiny Qwen3, by hand: per layer q [512, 256], k and v [256, 256], o [256, 512],
# gate, up and down 3 x [512, 256]; two layers; embedding and head [256, 256].
WEIGHTS = 2 * (512 * 256 + 2 * 256 * 256 + 256 * 512 + 3 * 512 * 256) + 2 * 256 * 256
HALF_LAYER = (256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 256 * 256) + 4 * (4 + 2 * 2 + 4 + 3 * 4)
"""What a rank missing half of every weight of a layer receives, quantized: half of q (256x256, 2x2 blocks), k
and v (128x256, 1x2), o (256x256, 2x2), gate, up and down (256x256, 2x2 each), one byte an element and four a
block."""
MISSING_HALVES = 2 * HALF_LAYER + 2 * (128 * 256) * 2
"""Both layers' missing halves, quantized, and the embedding's and head's other halves (128x256) in bf16."""


@pytest.mark.parametrize("where", ["own process", "in process"])
def test_a_megatron_tp2_trainer_into_fp8_tp2(tmp_path, where):
    """Megatron TP 2 over 2 ranks holds half of every weight (whole 128-blocks) and the norms whole, which is
    each TP 2 engine rank's unquantized shard, and each rank's engine holds half the FP8 rows or columns.
    An engine in its own process takes that shard, quantized where it lies: nothing moves between the ranks.
    vLLM in the trainer's process takes its stage's FP8 checkpoint tensors, whole: each rank receives the
    other halves, quantized (as into TP 1 engines, below)."""
    process = ["--engine-process"] if where == "own process" else []
    plan = _plan(tmp_path, "--world", "2", "--train", "2/1/1", "--infer", "2/1/1", "--infer-dtype", "fp8",
                 *process)
    assert WEIGHTS == 1_703_936
    moved = 0 if process else MISSING_HALVES
    for rank in plan["ranks"]:
        assert rank["state_nbytes"]["engine_weights"] == 2 * _layer(512, 256, 2) + (256 * 256 + 256) * 2 \
            == 921_280
        assert rank["received_nbytes"] == rank["sent_nbytes"] == moved
        sync = next(s for s in rank["to_infer"] if s["name"] == "weight sync")
        assert sync["network_nbytes"] == 2 * moved


def test_a_megatron_tp2_trainer_into_fp8_tp1_engines_moves_each_ranks_missing_half(tmp_path):
    """Into two TP 1 engines (one a rank) each engine rank needs every weight: it receives the half its
    Megatron shard lacks and sends its own half to the other. Each half of a quantized weight is whole
    128-blocks, so it moves quantized: per layer half of q (256x256, 2x2 blocks), k and v (128x256, 1x2), o
    (256x256, 2x2), gate, up and down (256x256, 2x2 each), one byte an element and four a block; the
    embedding's and head's other halves (128x256) in bf16, two bytes an element (in bf16 throughout the
    weights' halves alone were WEIGHTS bytes)."""
    plan = _plan(tmp_path, "--world", "2", "--train", "2/1/1", "--infer", "1/1/1", "--infer-dtype", "fp8",
                 "--engine-process")
    moved = MISSING_HALVES
    for rank in plan["ranks"]:
        assert rank["state_nbytes"]["engine_weights"] == 2 * _layer(1024, 512, 2) + (2 * 256 * 256 + 256) * 2
        assert rank["received_nbytes"] == rank["sent_nbytes"] == moved == 917_696
        sync = next(s for s in rank["to_infer"] if s["name"] == "weight sync")
        assert sync["network_nbytes"] == 2 * moved


@pytest.mark.parametrize("args,message", [
    (["--family", "qwen2"], "--infer-dtype fp8: family='qwen2' has no FP8 layout"),
    (["--param-dtype", "fp8"], "--infer-dtype fp8 with --param-dtype fp8: the engine's FP8 weights are "
                               "quantized from the training weights"),
    (["--lora-rank", "8"], "--infer-dtype fp8 is planned without --lora-rank"),
])
def test_what_fp8_cannot_plan_is_named(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main([*QWEN3, "--world", "1", "--infer-dtype", "fp8", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err
