"""An engine stand-in that holds a Qwen3 as vLLM's classes built with ``quantization="fp8"`` hold it, and the
independent reference of what it must hold after a sync: vLLM's own quantizer (``per_block_cast_to_fp8``, its
eager body, as tests/reshard/test_vllm_fp8.py runs it) applied to the full training weights, fused and cut by
hand (tests/weight_sync/test_fp8_sync.py; over gloo ranks, tests/reshard/test_layout_stream.py)."""

from __future__ import annotations

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.reshard import ModelSpec
from hybridmem.weight_sync import ReshardSync
from tests.reshard.reference import megatron_shard

BATCH = torch.tensor([[3, 17, 42, 99, 5, 8], [1, 2, 3, 4, 5, 6]])
"""The token ids of the training steps the FP8 switch tests take."""
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CONFIG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
              intermediate_size=512, num_hidden_layers=2, vocab_size=256, max_position_embeddings=64,
              tie_word_embeddings=False)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}
"""vLLM's fused Qwen3 linear layers and the checkpoint weights each is made of, in order."""
NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def vllm_quantizer():
    pytest.importorskip("vllm")
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8._torchdynamo_orig_callable


def cut(t: torch.Tensor, axis: int, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``tp`` equal parts of ``t`` along ``axis``."""
    n = t.shape[axis] // tp
    return t.narrow(axis, rank * n, n)


def reference(full: dict[str, torch.Tensor], *, rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen3 at TP ``tp`` (vocab 256, no padding; kv heads 2, so none replicated at TP <= 2)
    holds on ``rank`` from the FP8 checkpoint vLLM's quantizer makes of ``full``: each part of a fused layer
    quantized whole, cut (rows of column-parallel layers, columns of o_proj and down_proj; scales by
    128-blocks) and concatenated; the rest bf16."""
    quantize = vllm_quantizer()
    bf16 = lambda name: full[name].to(torch.bfloat16)  # noqa: E731
    out = {"model.embed_tokens.weight": cut(bf16("model.embed_tokens.weight"), 0, rank, tp)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for fused, parts in FUSED.items():
            axis = 1 if fused in ("self_attn.o_proj", "mlp.down_proj") else 0
            weights, scales = zip(*(quantize(full[f"{p}{part}.weight"], [128, 128]) for part in parts))
            parts_cut = [cut(w.view(torch.uint8), axis, rank, tp) for w in weights]
            out[f"{p}{fused}.weight"] = torch.cat(parts_cut, dim=0).view(torch.float8_e4m3fn)
            out[f"{p}{fused}.weight_scale_inv"] = torch.cat([cut(s, axis, rank, tp) for s in scales], dim=0)
        out.update((f"{p}{n}.weight", bf16(f"{p}{n}.weight")) for n in NORMS)
    out["model.norm.weight"] = bf16("model.norm.weight")
    out["lm_head.weight"] = cut(bf16("lm_head.weight"), 0, rank, tp)
    return out


class Fp8Engine:
    """Holds the reference's tensors (names, shapes, dtypes) as vLLM's FP8 Qwen3 at TP ``tp`` does, and copies
    into them what its layout stream gives; a tensor it does not hold, or of another shape or dtype, fails."""

    capabilities = EngineCapabilities(streams_layout=True, reports_weight_coverage=True,
                                      describes_weights=True, reports_layout=True, reports_quantization=True)
    dtype = torch.bfloat16
    vocab_size = CONFIG["vocab_size"]

    def __init__(self, like: dict[str, torch.Tensor], quantization_config=FP8, tp: int = 1):
        self.parallel_layout = ParallelLayout(tp=tp)
        self.params = {n: torch.zeros_like(t) for n, t in like.items()}
        self.quantization_config = quantization_config
        self.written: set[str] = set()

    def load_layout_weights(self, weights):
        for name, tensor in weights:
            held = self.params[name]
            assert name not in self.written, name
            assert (tensor.shape, tensor.dtype) == (held.shape, held.dtype), (name, tensor.dtype)
            held.copy_(tensor)
            self.written.add(name)

    def unwritten_weights(self) -> list[str]:
        return [n for n in self.params if n not in self.written]

    def load_weights(self, weights):
        raise AssertionError("an engine that streams its own layout is not handed HF tensors")

    def release(self, tags):
        if "weights" in tags:
            self.written = set()

    def resume(self, tags):
        if "weights" in tags:
            self.written = set()


def checkpoint_reference(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint vLLM's quantizer makes of ``full`` (the Qwen3's q/k/v/o and MLP weights e4m3 with
    their ``weight_scale_inv``; embedding, norms and head as they are), cast to bf16 where unquantized."""
    quantize = vllm_quantizer()
    out = {}
    for name, tensor in full.items():
        if name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize(tensor, [128, 128])
        else:
            out[name] = tensor.to(torch.bfloat16)
    return out


class Fp8CheckpointEngine:
    """Takes full HF-named tensors through ``load_weights`` and reports FP8 (as vLLM in the trainer's process
    does); keeps what it is handed, by name, and fails on a name handed twice."""

    capabilities = EngineCapabilities(reports_quantization=True)
    dtype = torch.bfloat16
    vocab_size = CONFIG["vocab_size"]

    def __init__(self, quantization_config=FP8, tp: int = 1):
        self.parallel_layout = ParallelLayout(tp=tp)
        self.quantization_config = quantization_config
        self.handed: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            assert name not in self.handed, name
            self.handed[name] = tensor.clone()

    def release(self, tags):
        if "weights" in tags:
            self.handed = {}

    def resume(self, tags):
        pass


def full_weights(model) -> dict[str, torch.Tensor]:
    """The training model's full weights by name, cloned."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_step(model, opt) -> dict[str, torch.Tensor]:
    """One likelihood step of ``model`` on :data:`BATCH`; returns :func:`reference` of the weights it left,
    what an FP8 engine must hold after the next sync."""
    model.train()
    model(BATCH, labels=BATCH).loss.backward()
    opt.step()
    opt.zero_grad()
    return reference(full_weights(model))


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtypes and bits (e4m3 compared as bytes)."""
    if want.dtype == torch.float8_e4m3fn:
        return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return got.dtype == want.dtype and torch.equal(got, want)


def sync_task(ctx, full: dict[str, torch.Tensor], likes: list[dict[str, torch.Tensor]] | None, tp: int,
              infer_tp: int | None = None, config: dict | None = None, verify: bool = False):
    """Per rank: the training weights ``full`` sharded as Megatron-core at TP ``tp`` (the reference's
    shards), synced by a ReshardSync into an :class:`Fp8Engine` at TP ``infer_tp`` (``None``: ``tp``) holding
    tensors like ``likes[rank]`` (the rank's reference), or, where ``likes`` is ``None``, into an
    :class:`Fp8CheckpointEngine`, of the Qwen3 ``config`` (``None``: :data:`CONFIG`), comparing per-slice
    checksums where ``verify``; returns what the engine holds (or was handed), the sync's engine bytes and the
    bytes the rank sent to and received from the others."""
    spec = ModelSpec.from_hf_config(dict(config or CONFIG, model_type="qwen3"))
    infer_tp = tp if infer_tp is None else infer_tp
    train = megatron_shard(full, spec, tp=tp, pp=1, ep=1, world=ctx.world_size, rank=ctx.rank)
    engine = Fp8Engine(likes[ctx.rank], tp=infer_tp) if likes else Fp8CheckpointEngine(tp=infer_tp)
    sync = ReshardSync(spec, ParallelLayout(tp=tp), ParallelLayout(tp=infer_tp), ctx.group, lambda: train,
                       engine, verify=verify)
    engine.resume(["weights"])
    stats = sync.sync()
    if likes:
        assert not stats.unwritten and stats.coverage_checked
    held = engine.params if likes else engine.handed
    return held, stats.engine_nbytes, stats.sent_nbytes, stats.received_nbytes
