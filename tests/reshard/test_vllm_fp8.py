"""FP8 block-quantized rollouts: hybridmem's quantizer and FP8 vLLM layout against vLLM's own.

- The quantizer equals vLLM's ``per_block_cast_to_fp8`` (vllm/utils/deep_gemm.py) bit for bit: in CI its
  Python body run eagerly (the torch-compiled function vLLM calls costs a compile per dtype); with
  ``HYBRIDMEM_TESTS_FULL=1`` the compiled function itself. The program of the last test uses the compiled one.
- Bad input is refused by name before anything is built or written: another block shape, a shard boundary
  inside a block, a training dtype the quantizer cannot take, another quantization, a family whose FP8
  layout is not checked, a plan into an FP8 layout.
- vLLM's own classes with ``quantization="fp8"`` (``tests/reshard/_fp8_program.py``, a program of its own
  under each supported release's Python, as tests/adapters/test_vllm_transfer_versions.py runs its program):
  after a sync from bf16 weights every parameter and scale equals what vLLM loads from the FP8 checkpoint its
  own quantizer makes, at TP 1/2/4 and PP 2 (Qwen3, Llama; Mistral at TP 4) and TP 1/2, EP 2 and PP 2
  (Qwen3-MoE, GLM-4.5, DeepSeek-V3; DeepSeek-V3 without q_lora_rank at TP 2; Qwen3-MoE with 512-row experts
  at TP 4, with and without EP 4), and a layout hybridmem refuses
  (DeepSeek-V3's q_b_proj split inside a block at TP 4; a q_lora_rank of 192) vLLM fails to build or load.
  The installed release (0.32 in CI) runs it only with ``HYBRIDMEM_TESTS_FULL=1`` (minutes); another
  release's Python named in ``HYBRIDMEM_VLLM_PYTHONS`` runs it whenever given.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, build_plan, hf_source_layout, iter_shard, vllm_layout
from hybridmem.reshard.conventions import VLLMConvention
from hybridmem.reshard.fp8 import block_from_hf_config, quantize_block_fp8, quantize_stream
from hybridmem.reshard.layouts import fp8_quantized_names
from hybridmem.reshard.vllm_versions import SUPPORTED_VLLM_VERSIONS
from tests._full import full_only
from tests.adapters.test_vllm_transfer_versions import release_program
from tests.reshard._fp8_program import MODELS

DENSE = dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             intermediate_size=512, num_hidden_layers=2, vocab_size=256, tie_word_embeddings=False)
MOE = dict(DENSE, model_type="qwen3_moe", moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
FP8 = VLLMConvention(weight_block_size=(128, 128))


def _edge_tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    """Weights that reach every branch of the quantizer: sides that are not multiples of 128 (edge blocks), an
    all-zero block and one below the 1e-4 floor, a block whose maximum is huge, negative zeros, ties."""
    torch.manual_seed(1)
    a = torch.randn(300, 260) * 3
    a[:128, :128] = 0
    a[128:256, :128] = torch.randn(128, 128) * 1e-6
    a[:128, 128:256] = torch.randn(128, 128) * 1e4
    a[256:, 256:] = -0.0
    b = torch.randn(128, 384)
    c = torch.linspace(-2, 2, 256 * 128).reshape(256, 128)
    return [t.to(dtype) for t in (a, b, c)]


def _vllm_quantizer(compiled: bool):
    pytest.importorskip("vllm")
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8 if compiled else per_block_cast_to_fp8._torchdynamo_orig_callable


_COMPILED = full_only("the eager case runs the same body; compiling costs 10 s per dtype")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=_COMPILED)])
def test_quantizer_is_vllms_bit_for_bit(compiled):
    theirs = _vllm_quantizer(compiled)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for x in _edge_tensors(dtype):
            before = x.clone()
            w, s = quantize_block_fp8(x)
            assert torch.equal(x, before)  # left as it was (an fp32 weight of whole blocks too)
            w_ref, s_ref = theirs(x, [128, 128])
            assert w.dtype == w_ref.dtype == torch.float8_e4m3fn and s.dtype == s_ref.dtype == torch.float32
            assert torch.equal(w.view(torch.uint8), w_ref.view(torch.uint8)), (dtype, tuple(x.shape))
            assert torch.equal(s, s_ref), (dtype, tuple(x.shape))


def test_quantizer_values_by_hand():
    # One block: max |w| = 448 * 2 gives the scale 2; 3.0 / 2 = 1.5 is an e4m3 value, 448 stays 448.
    x = torch.zeros(128, 128)
    x[0, 0], x[5, 7], x[127, 127] = 896.0, 3.0, -896.0
    w, s = quantize_block_fp8(x)
    assert s.tolist() == [[2.0]]
    assert (w[0, 0].item(), w[5, 7].item(), w[127, 127].item(), w[1, 1].item()) == (448.0, 1.5, -448.0, 0.0)
    # An all-zero block takes the 1e-4 floor.
    assert quantize_block_fp8(torch.zeros(4, 4))[1].item() == pytest.approx(1e-4 / 448.0)


def test_fp8_layout_shapes_and_bytes_by_hand(capsys):
    """Qwen3 at TP 4 (kv heads 2, so each kv head on two ranks): every quantized weight is whole blocks;
    scales are [rows / 128, columns / 128]; what is not quantized keeps the bf16 layout. The bytes per rank:
    FP8 weights one byte an element, scales four, the rest two."""
    spec = ModelSpec.from_hf_config(DENSE)
    fp8 = vllm_layout(spec, ParallelLayout(tp=4), 4, convention=FP8).tensors(1)
    bf16 = vllm_layout(spec, ParallelLayout(tp=4), 4).tensors(1)
    p = "model.layers.0."
    want = {p + "self_attn.qkv_proj.weight": (384, 256), p + "self_attn.qkv_proj.weight_scale_inv": (3, 2),
            p + "self_attn.o_proj.weight": (256, 128), p + "self_attn.o_proj.weight_scale_inv": (2, 1),
            p + "mlp.gate_up_proj.weight": (256, 256), p + "mlp.gate_up_proj.weight_scale_inv": (2, 2),
            p + "mlp.down_proj.weight": (256, 128), p + "mlp.down_proj.weight_scale_inv": (2, 1)}
    assert {n: fp8[n].shape for n in want} == want
    assert set(fp8) - set(bf16) == {n for n in fp8 if n.endswith("_scale_inv")}
    assert all(fp8[n] == bf16[n] for n in bf16)
    # Rank 1's k rows: kv head 0 (ranks 0 and 1 share it), block row 0 of k_proj's scales.
    k = [q for q in fp8[p + "self_attn.qkv_proj.weight_scale_inv"].pieces if "k_proj" in q.hf_name]
    assert [(q.src, q.dst_start) for q in k] == [(((0, 1), (0, 2)), (1, 0))]
    names = fp8_quantized_names(spec)
    assert len(names) == 2 * 7 and not any("norm" in n or "embed" in n or "lm_head" in n for n in names)
    full = {n: torch.randn(s, dtype=torch.bfloat16) for n, s in spec.full_shapes().items()}
    for rank in range(4):
        layout = vllm_layout(spec, ParallelLayout(tp=4), 4, convention=FP8)
        ours = dict(iter_shard(quantize_stream(full.items(), names), layout, rank))
        fp8_nbytes = sum(t.numel() * t.element_size() for t in ours.values())
        bf16_nbytes = sum(t.numel() * 2 for n, t in ours.items() if not n.endswith("_scale_inv"))
        weights = sum(fp8[n].numel for n in want if not n.endswith("_scale_inv"))
        scales = sum(fp8[n].numel for n in want if n.endswith("_scale_inv"))
        # two layers; each weight element saves one byte, each scale costs four
        assert bf16_nbytes - fp8_nbytes == 2 * (weights - 4 * scales)
        print(f"rank {rank}: fp8 {fp8_nbytes} bytes, bf16 {bf16_nbytes} bytes")
    assert "rank 3: fp8" in capsys.readouterr().out


def test_mla_fp8_layout_by_hand():
    """DeepSeek-V3 at TP 2, rank 1 (q_lora_rank 256, kv_lora_rank 128 + rope 64, 4 heads of 128 + 64 / 128):
    fused_qkv_a_proj is q_a's 256 rows then kv_a's 192, its scales q_a's two block rows then kv_a's two (the
    last half full); q_b_proj, kv_b_proj by rows and o_proj by columns cut whole blocks; the router and its
    correction bias are not quantized (vLLM builds the gate without the quantization config)."""
    spec = ModelSpec.from_hf_config(MODELS["deepseek_v3"])
    fp8 = vllm_layout(spec, ParallelLayout(tp=2), 2, convention=FP8).tensors(1)
    a, m = "model.layers.0.self_attn.", "model.layers.1.mlp."
    boxes = {n: [(q.hf_name.removeprefix(a), q.src, q.dst_start) for q in fp8[a + n].pieces]
             for n in ("fused_qkv_a_proj.weight_scale_inv", "q_b_proj.weight_scale_inv",
                       "kv_b_proj.weight_scale_inv", "o_proj.weight_scale_inv")}
    assert boxes == {
        "fused_qkv_a_proj.weight_scale_inv": [
            ("q_a_proj.weight_scale_inv", ((0, 2), (0, 2)), (0, 0)),
            ("kv_a_proj_with_mqa.weight_scale_inv", ((0, 2), (0, 2)), (2, 0))],
        "q_b_proj.weight_scale_inv": [("q_b_proj.weight_scale_inv", ((3, 6), (0, 2)), (0, 0))],
        "kv_b_proj.weight_scale_inv": [("kv_b_proj.weight_scale_inv", ((4, 8), (0, 1)), (0, 0))],
        "o_proj.weight_scale_inv": [("o_proj.weight_scale_inv", ((0, 2), (2, 4)), (0, 0))]}
    assert fp8[a + "fused_qkv_a_proj.weight"].shape == (448, 256)
    assert fp8[a + "fused_qkv_a_proj.weight_scale_inv"].shape == (4, 2)
    assert {m + "gate.weight", m + "gate.e_score_correction_bias",
            m + "shared_experts.gate_up_proj.weight_scale_inv"} <= set(fp8)
    assert sum(n.startswith(m + "experts.") and n.endswith("_scale_inv") for n in fp8) == 2  # w13, w2
    assert not {m + "gate.weight_scale_inv", a + "q_a_layernorm.weight_scale_inv"} & set(fp8)


def test_bad_input_is_named():
    dense, moe = ModelSpec.from_hf_config(DENSE), ModelSpec.from_hf_config(MOE)
    with pytest.raises(ValueError, match=r"weight_block_size=\(64, 128\).*128x128 blocks only"):
        VLLMConvention(weight_block_size=(64, 128))
    with pytest.raises(ValueError, match=r"weight_block_size=\[128, 64\]"):
        block_from_hf_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}})
    with pytest.raises(ValueError, match="quant_method='awq'"):
        block_from_hf_config({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="without weight_block_size"):
        block_from_hf_config({"quantization_config": {"quant_method": "fp8"}})
    assert block_from_hf_config({"model_type": "qwen3"}) is None
    # Experts of 256 rows over TP 4: 64 rows a rank, inside the first 128-block.
    with pytest.raises(ValueError, match=r"holds rows \[0, 64\) of model\.layers\.0\.mlp\.experts\.0\."
                                         r"gate_proj\.weight.*shard boundary inside a 128-block"):
        vllm_layout(moe, ParallelLayout(tp=4), 4, convention=FP8)
    with pytest.raises(ValueError, match="dtype torch.float64 cannot be block-quantized"):
        quantize_block_fp8(torch.zeros(128, 128, dtype=torch.float64), name="w")
    name = fp8_quantized_names(dense)[0]
    stream = quantize_stream([(name, torch.zeros(dense.full_shapes()[name], dtype=torch.int8))], [name])
    with pytest.raises(ValueError, match=f"{name}: dtype torch.int8 cannot"):
        next(stream)
    with pytest.raises(ValueError, match="family='qwen2': no FP8 layout"):
        vllm_layout(ModelSpec.from_hf_config(dict(DENSE, model_type="qwen2")), ParallelLayout(), 1,
                    convention=FP8)
    # DeepSeek-V3: q_b_proj's 768 rows over TP 4, 192 a rank (vLLM refuses it too: the program checks that).
    with pytest.raises(ValueError, match=r"holds rows \[0, 192\) of model\.layers\.0\.self_attn\.q_b_proj\."
                                         r"weight.*shard boundary inside a 128-block"):
        vllm_layout(ModelSpec.from_hf_config(MODELS["deepseek_v3"]), ParallelLayout(tp=4), 4, convention=FP8)
    # A q_lora_rank that is not whole blocks: q_a's and kv_a's rows would share a block of fused_qkv_a_proj.
    with pytest.raises(ValueError, match=r"q_lora_rank=192 \(family='deepseek_v3'\) is not a multiple of "
                                         r"128: vLLM fuses q_a_proj and kv_a_proj_with_mqa"):
        vllm_layout(ModelSpec.from_hf_config(dict(MODELS["deepseek_v3"], q_lora_rank=192)), ParallelLayout(),
                    1, convention=FP8)
    with pytest.raises(ValueError, match=r"destination weight_block_size=\[128, 128\]: a plan moves"):
        build_plan(hf_source_layout(dense, 2, shard_size=2), vllm_layout(dense, ParallelLayout(tp=2), 2,
                                                                          convention=FP8))


@pytest.mark.slow
@pytest.mark.parametrize("release", SUPPORTED_VLLM_VERSIONS)
def test_vllm_fp8_classes_load_what_a_sync_writes(tmp_path, release):
    report = release_program(release, "tests.reshard._fp8_program", out=tmp_path / "report.json",
                             timeout_s=1800,
                             installed_only_when_full="the installed vLLM's FP8 run takes minutes")
    assert not report["failures"]
    cases = {(c["model"], c["tp"], c["pp"], c["ep"]) for c in report["cases"]}
    assert {("qwen3", 4, 1, 1), ("qwen3", 1, 2, 1), ("qwen3_moe", 2, 1, 2), ("llama", 4, 1, 1),
            ("llama", 1, 2, 1), ("glm4_moe", 2, 1, 2), ("glm4_moe", 1, 2, 1), ("deepseek_v3", 2, 1, 2),
            ("deepseek_v3", 1, 2, 1), ("deepseek_v3_no_q_lora", 2, 1, 1), ("mistral", 4, 1, 1),
            ("qwen3_moe_wide", 4, 1, 1), ("qwen3_moe_wide", 4, 1, 4), ("deepseek_v32", 2, 1, 1),
            ("deepseek_v32", 2, 1, 2), ("deepseek_v32", 1, 2, 1), ("glm5", 2, 1, 2)} <= cases
    # Refused by both: hybridmem names the weight; vLLM's validate_fp8_block_shape names the partition size,
    # and loading kv_a's block scales into fused_qkv_a_proj's grid (q_lora_rank 192) runs past its 3 rows.
    q_b, q_lora = report["refused"]
    assert "q_b_proj.weight holds rows [0, 192)" in q_b["hybridmem"]
    assert q_b["vllm"] == ["build: Weight output_partition_size = 192 is not divisible by weight "
                           "quantization block_n = 128."] * 4
    assert q_lora["hybridmem"].startswith("q_lora_rank=192 (family='deepseek_v3') is not a multiple of 128")
    assert q_lora["vllm"] == ["load: start (2) + length (2) exceeds dimension size (3)."] * 4
    for case in report["cases"]:
        for rank in case["ranks"]:
            assert rank["fp8_tensors"] == rank["scales"] > 0 and rank["compared"] == rank["tensors"], rank
            assert rank["fp8_nbytes"] < rank["bf16_nbytes"], rank
