"""Module-level tasks run in WorkerPool processes by test_fsdp.py (importable by spawn).

Each task trains a transformers model on every rank of a 4-rank gloo group (FSDP2 or replicated),
built from a config with the same seed on every rank, and switches it into a ReferenceEngine (or a
vLLM-layout parameter engine) with the user-facing code: ``new_subgroups(k)``, ``ReferenceEngine(
cfg.to_dict(), group=tp_group)``, ``ShardingManager(model, engine, optimizer=opt, config=HybridConfig(
infer_tensor_parallel_size=k), model_spec=cfg)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hybridmem import HybridConfig, PhaseError, ShardingManager
from hybridmem.engines import ReferenceEngine, SamplingParams
from hybridmem.offload import optimizer_state_tensors
from hybridmem.switch.phase import Direction

_COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=256, rms_norm_eps=1e-6)
CASES = {
    # q/k/v bias, 2 kv heads: at k = 4 each kv head sits on 2 ranks. 250 vocab rows over 4 ranks: 63/63/63/61.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(_COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=False)),
    # Tied embeddings (one tensor, sharded once), one kv head.
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(_COMMON, num_attention_heads=4, num_key_value_heads=1,
                                                       tie_word_embeddings=True)),
    # Mistral (Llama's rules), no sliding window.
    "mistral": (MistralConfig, MistralForCausalLM,
                dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
                     tie_word_embeddings=False)),
    # Phi-3: q/k/v and gate/up fused in the modules and the checkpoint.
    "phi3": (Phi3Config, Phi3ForCausalLM,
             dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)),
    # transformers 5's fused experts; 6 experts over 4 ranks: 2/2/2/0 (the last rank holds none).
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                       num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)),
}
PROMPTS = [[3, 17, 42, 99, 5], [7, 8], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 249, 0]]
MAX_TOKENS = 6


def build(case: str, *, fsdp: bool, seed: int = 0):
    cfg_cls, model_cls, kwargs = CASES[case]
    cfg = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return cfg, model


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1000 * step + rank))


def _train_step(model, opt, rank: int, step: int) -> torch.Tensor:
    """One AdamW step of the causal-LM loss on this rank's batch; returns the loss."""
    opt.zero_grad()
    x = _batch(rank, step)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    return loss


def hf_greedy(case: str, full: dict) -> list[list[int]]:
    """transformers' own greedy continuation of PROMPTS from the full weights."""
    cfg_cls, model_cls, kwargs = CASES[case]
    model = model_cls(cfg_cls(**kwargs)).eval()
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _storages(model, opt) -> dict[str, list[int]]:
    return {
        "params": [_local(p).untyped_storage().nbytes() for p in model.parameters()],
        "grads": [_local(p.grad).untyped_storage().nbytes()
                  for p in model.parameters() if p.grad is not None],
        "optimizer": [_local(t).untyped_storage().nbytes() for t in optimizer_state_tensors(opt)],
    }


def _snapshot(model, opt) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *optimizer_state_tensors(opt)]
    return [_local(t).detach().clone() for t in tensors]


def train_task(ctx, case: str, k: int, *, switch: bool, fsdp: bool = True, steps: int = 3,
               eval_forward: bool = True):
    """Train ``steps`` AdamW steps; with ``switch``, go through ``manager.inference()`` after each.

    Returns per step: the loss, and with ``switch`` the engine's greedy tokens, transformers' greedy tokens
    of the full weights, the weight sync's figures, the storage bytes inside INFER, FSDP2's unsharded bytes
    before the switch and inside INFER, and whether every local tensor came back bitwise.
    """
    cfg, model = build(case, fsdp=fsdp)
    # Without FSDP2: DDP, every rank holding the whole model; the manager gets the inner module.
    trained = model if fsdp else torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = None
    if switch:
        tp_group, _ = dist.new_subgroups(k)
        engine = ReferenceEngine(cfg.to_dict(), group=tp_group)
        engine.release(["weights", "kv_cache"])
        manager = ShardingManager(model, engine, optimizer=opt,
                                  config=HybridConfig(infer_tensor_parallel_size=k), model_spec=cfg)
    out = []
    for step in range(steps):
        loss = _train_step(trained, opt, ctx.rank, step)
        x = _batch(ctx.rank, step)
        record = {"loss": loss.item()}
        before = _snapshot(model, opt) if manager is not None else None  # sharded: before the eval forward
        if eval_forward:  # as an RL step scores rollouts: FSDP2 keeps the root unsharded after it
            with torch.no_grad():
                model(input_ids=x)
        if manager is not None:
            full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in model.named_parameters()}
            record["ref_tokens"] = hf_greedy(case, full) if ctx.rank == 0 else None
            record["unsharded_before"] = manager.training.unsharded_nbytes() if fsdp else None
            with manager.inference() as eng:
                record["infer_storages"] = _storages(model, opt)
                record["unsharded_infer"] = manager.training.unsharded_nbytes() if fsdp else None
                record["leftovers"] = dict(manager.residency().leftovers)
                record["tokens"] = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=0.0))]
            sync = next(s for s in manager.last_reports[Direction.TO_INFER].steps if s.name == "weight sync")
            record["sync"] = dict(sync.extra)
            record["restored"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))
        out.append(record)
    return out


def misuse_task(ctx):
    """Inside ``inference()``: a forward and an optimizer step of the FSDP2 model, each caught; then the
    same 2 training steps a run without switches takes. Returns what was refused and the losses."""
    cfg, model = build("qwen2", fsdp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ReferenceEngine(cfg.to_dict(), group=dist.new_subgroups(1)[0])
    manager = ShardingManager(model, engine, optimizer=opt, model_spec=cfg)
    refused, losses = [], []
    for step in range(2):
        losses.append(_train_step(model, opt, ctx.rank, step).item())
        with manager.inference():
            for what, call in (
                ("forward", lambda: model(input_ids=_batch(ctx.rank, step))),  # noqa: B023 - called in this iteration
                ("step", opt.step),
            ):
                try:
                    call()
                except PhaseError as exc:
                    refused.append((what, str(exc)))
    return {"refused": refused, "losses": losses}


class VLLMParamEngine:
    """An engine exposing vLLM-named, vLLM-shaped tensors (NaN until written) through named_parameters()."""

    def __init__(self, tensors):
        self.tensors = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}

    def named_parameters(self):
        return iter(self.tensors.items())

    def load_weights(self, weights):
        raise AssertionError("the in-place sync must not call load_weights")

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


def moe_task(ctx, k: int, steps: int = 2):
    """Qwen3-MoE under FSDP2 into a vLLM TP ``k`` layout; returns per step the engine's tensors, the full
    weights (``full_tensor()``), the sync figures and whether the training state came back bitwise."""
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, allocate_local, vllm_layout

    cfg, model = build("qwen3_moe", fsdp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = vllm_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(tp=k), ctx.world_size)
    engine = VLLMParamEngine(allocate_local(dst, ctx.rank, dtype=torch.float32))
    with torch.no_grad():  # the manager is built while FSDP2 leaves the root unsharded after a forward
        model(input_ids=_batch(ctx.rank, 0))
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig(infer_tensor_parallel_size=k),
                              model_spec=cfg)
    out = []
    for step in range(steps):
        loss = _train_step(model, opt, ctx.rank, step)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()}
        before = _snapshot(model, opt)
        with manager.inference():
            storages = _storages(model, opt)
            unsharded = manager.training.unsharded_nbytes()
            got = {n: t.clone() for n, t in engine.named_parameters()}
        sync = next(s for s in manager.last_reports[Direction.TO_INFER].steps if s.name == "weight sync")
        out.append({"loss": loss.item(), "engine": got, "full": full if ctx.rank == 0 else None,
                    "sync": dict(sync.extra), "infer_storages": storages, "unsharded_infer": unsharded,
                    "restored": all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt))),
                    "local_experts": _local(model.model.layers[0].mlp.experts.gate_up_proj).shape[0]})
    return out


def buffers_task(ctx):
    """FSDP2 on CUDA keeps the last all-gather result and reduce-scatter input in its communication
    context (on CPU it keeps none): put such buffers there, as FSDP2's own records, and release."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
        AllGatherState,
        ReduceScatterState,
    )

    from hybridmem.adapters.fsdp import FSDPTrainingState
    from hybridmem.switch.steps import FSDP_BUFFERS, ReleaseBuffersStep

    _, model = build("qwen2", fsdp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _batch(ctx.rank, 0)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    state = FSDPTrainingState(model, opt)
    root_unsharded = state.unsharded_nbytes()  # after backward: nothing kept on CPU
    with torch.no_grad():
        model(input_ids=x)
    after_eval = state.unsharded_nbytes()
    comm = model._get_fsdp_state()._comm_ctx
    gathered, scattered = torch.ones(1000), torch.ones(300)
    comm.all_gather_state = AllGatherState(AllGatherResult(gathered, None, None, [], [], []), None)
    comm.reduce_scatter_states.append(ReduceScatterState(scattered, None))
    with_comm = state.unsharded_nbytes()
    step = ReleaseBuffersStep(state.buffers, FSDP_BUFFERS)
    planned = step.estimate().free_nbytes
    result = step.run()
    return {"after_backward": root_unsharded, "after_eval": after_eval, "with_comm": with_comm,
            "planned": planned, "released": result.extra["released_nbytes"], "left": state.unsharded_nbytes(),
            "comm_left": (comm.all_gather_state is not None, len(comm.reduce_scatter_states)),
            # FSDP2 all-gathers padded shards: ceil(rows / world) * world rows per root parameter.
            "root_nbytes": sum(-(-p.shape[0] // ctx.world_size) * ctx.world_size * p[0].numel() * 4
                               for n, p in model.named_parameters() if not n.startswith("model.layers."))}
