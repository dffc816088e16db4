"""One rank of the GRPO demo: generate (INFER) -> reference and old log-probs -> update (TRAIN).

Every iteration on every rank:

1. ``with manager.inference() as engine``: TRAIN -> INFER offloads the optimizer state, grads and
   weights, reshards the training weights (Megatron layout, training TP) into the engine (vLLM layout,
   inference TP) and takes the KV cache; each inference replica samples ``group_size`` completions for
   its share of the prompts; the reference policy is onloaded beside the engine to score them, then
   offloaded; the switch back releases the KV cache and the engine's weights and onloads training state.
2. Rollouts are gathered on every rank; rewards and group-normalised advantages are computed.
3. The actor recomputes the old log-probs (and checks them against the engine's: the two layouts hold
   the same weights, so they agree to float rounding) and takes ``ppo_epochs`` clipped-policy steps,
   averaging gradients over its data-parallel group.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridmem import Direction, HybridConfig, ShardingManager
from hybridmem.examples.grpo.algo import GRPOConfig, group_advantages, policy_loss
from hybridmem.examples.grpo.engines import ENGINES, build_engine
from hybridmem.examples.grpo.task import CountTask
from hybridmem.examples.grpo.topology import Topology, build_topology
from hybridmem.examples.grpo.trainers import build_trainer
from hybridmem.reshard.spec import ModelSpec

__all__ = ["DemoConfig", "IterationStats", "run_rank"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Everything one demo run needs (the command line maps onto it)."""

    iters: int = 30
    num_prompts: int = 16
    """Prompts per iteration, over all inference replicas."""
    model: ModelSpec = field(default_factory=lambda: ModelSpec(
        family="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, num_hidden_layers=2, vocab_size=16, qkv_bias=True, rms_norm_eps=1e-6,
        rope_theta=10000.0,
    ))
    task: CountTask = field(default_factory=CountTask)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    hybrid: HybridConfig = field(default_factory=lambda: HybridConfig(device="cpu"))
    seed: int = 0
    dtype: str = "float32"
    trainer: str = "torch"
    """``torch`` (:class:`MegatronLayoutGPT`), ``megatron`` (megatron-core's GPTModel) or ``fsdp`` (a
    transformers model with ``fully_shard``, resharded by the manager's default weight sync)."""
    engine: str = "reference"
    """Rollout engine: ``reference`` (the embedded ReferenceEngine), ``vllm`` (a real vLLM in this process)
    or ``vllm-server`` (a real vLLM whose engine runs in a process of its own)."""

    def __post_init__(self) -> None:
        if self.model.vocab_size != self.task.vocab_size:
            raise ValueError(f"model vocab_size={self.model.vocab_size} differs from task vocab_size={self.task.vocab_size}")
        if self.iters < 1 or self.num_prompts < 1:
            raise ValueError(f"iters={self.iters} and num_prompts={self.num_prompts} must be >= 1")
        if self.trainer not in ("torch", "megatron", "fsdp"):
            raise ValueError(f"trainer={self.trainer!r}; expected 'torch', 'megatron' or 'fsdp'")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}; expected one of {ENGINES}")


@dataclass(frozen=True, slots=True)
class IterationStats:
    """Figures of one iteration (rank 0's view)."""

    iteration: int
    reward: float
    kl: float
    clip_frac: float
    logprob_gap: float
    """Max |engine log-prob - actor log-prob| over sampled tokens (resharding correctness)."""
    to_infer_s: float
    to_train_s: float
    moved_nbytes: int
    device_train_nbytes: int
    device_infer_nbytes: int
    ref_onload_s: float
    iter_s: float
    device_unexplained_nbytes: int | None = None
    """Device bytes in INFER outside the caching allocator (CUDA context, communicators, other allocators;
    ``ResidencyReport.unexplained_nbytes``), ``None`` on CPU."""


def _gather_rollouts(local: dict[str, Any], topo: Topology) -> list[dict[str, Any]]:
    """Every replica's rollouts on every rank (one entry per replica, in replica order)."""
    out: list[Any] = [None] * topo.world_size
    dist.all_gather_object(out, local)
    return [out[r * topo.infer.tp] for r in range(topo.num_infer_replicas)]


def run_rank(cfg: DemoConfig, *, on_iteration: Any = None) -> list[IterationStats]:
    """Run the demo on this rank (``torch.distributed`` initialised); returns rank-local stats.

    Args:
        cfg: The run.
        on_iteration: Called on every rank as ``on_iteration(stats, memory_samples)`` after each iteration.
    """
    topo = build_topology(cfg.hybrid.train_layout, cfg.hybrid.infer_layout)
    torch.manual_seed(cfg.seed)
    device = torch.device("cpu" if cfg.hybrid.device in ("auto", "cpu") else cfg.hybrid.device)
    dtype = getattr(torch, cfg.dtype)
    trainer = build_trainer(cfg.trainer, cfg.model, topo, seed=cfg.seed, lr=cfg.grpo.lr, dtype=dtype, device=device)
    engine = None
    try:
        max_len = cfg.task.prompt_len + cfg.task.completion_len
        seqs_per_replica = -(-cfg.num_prompts // topo.num_infer_replicas) * cfg.grpo.group_size
        # Built released: the manager starts in TRAIN with the engine's memory released.
        engine = build_engine(cfg.engine, cfg.model, topo, device=device, dtype=dtype, max_len=max_len,
                              max_seqs=seqs_per_replica)
        return _run(cfg, topo, trainer, engine, device, dtype, on_iteration)
    finally:
        trainer.close()
        close = getattr(engine, "close", None)
        if callable(close):  # vLLM's engine core (its cleanup also destroys the default process group)
            close()


def _run(cfg: DemoConfig, topo: Topology, trainer: Any, engine: Any, device: torch.device, dtype: torch.dtype,
         on_iteration: Any) -> list[IterationStats]:
    from hybridmem.weight_sync import ReshardSync  # noqa: PLC0415

    if cfg.trainer == "fsdp":  # the user's path: the manager finds the FSDP2 shards and reshards them
        manager = ShardingManager(trainer.training, engine, optimizer=trainer.optimizer, config=cfg.hybrid,
                                  model_spec=trainer.hf_config)
        return _loop(cfg, topo, trainer, manager, engine, device, dtype, on_iteration)
    sync = ReshardSync(
        cfg.model,
        src=cfg.hybrid.train_layout,
        dst=cfg.hybrid.infer_layout,
        group=None,
        source=trainer.named_weights,
        engine=engine,
        bucket_nbytes=cfg.hybrid.reshard_bucket_bytes,
        verify=cfg.hybrid.verify_weight_sync,
        dtype=dtype,
        megatron=trainer.megatron_convention(),
    )
    optimizer = trainer.optimizer if trainer.training is trainer.actor else None  # a MegatronTrainingState carries its own
    manager = ShardingManager(trainer.training, engine, optimizer=optimizer, config=cfg.hybrid, weight_sync=sync)
    trainer.attach(manager)
    return _loop(cfg, topo, trainer, manager, engine, device, dtype, on_iteration)


def _loop(cfg: DemoConfig, topo: Topology, trainer: Any, manager: ShardingManager, engine: Any, device: torch.device,
          dtype: torch.dtype, on_iteration: Any) -> list[IterationStats]:
    from hybridmem.engines import SamplingParams  # noqa: PLC0415

    manager.add_coresident("reference", trainer.reference)
    P, L, G = cfg.task.prompt_len, cfg.task.completion_len, cfg.grpo.group_size
    start = time.perf_counter()
    samples: list[tuple[float, str, dict[str, int]]] = []

    def mark(phase: str) -> None:
        samples.append((time.perf_counter() - start, phase, dict(manager.residency().by_owner)))

    stats: list[IterationStats] = []
    for it in range(cfg.iters):
        t_iter = time.perf_counter()
        prompts = cfg.task.prompts(cfg.num_prompts, seed=cfg.seed * 100_003 + it)
        mine = prompts[topo.infer_replica::topo.num_infer_replicas]
        mark("train")
        mark("switch")
        with manager.inference() as eng:
            mark("infer")
            outs = eng.generate(
                [p for p in mine for _ in range(G)],
                SamplingParams(max_tokens=L, temperature=cfg.grpo.temperature, seed=cfg.seed * 7919 + it * 31 + topo.infer_replica,
                               logprobs=True),
            )
            seqs = torch.tensor([o.prompt_ids + o.token_ids for o in outs], dtype=torch.long)
            engine_lp = torch.tensor([o.logprobs for o in outs], dtype=torch.float64)
            all_local = _gather_rollouts({"seqs": seqs, "engine_lp": engine_lp}, topo)
            seqs_all = torch.cat([r["seqs"] for r in all_local])
            rows = slice(topo.train_dp_rank, None, topo.train_dp_size)  # this rank's training share
            batch = seqs_all[rows].to(device)
            # The reference scores the rollouts beside the engine while the actor's state is on the host.
            t_ref = time.perf_counter()
            with manager.onloaded("reference") as ref, torch.no_grad():
                mark("reference")
                ref_lp = trainer.token_logprobs(ref, batch, temperature=cfg.grpo.temperature)[:, P - 1:]
            ref_s = time.perf_counter() - t_ref
            mark("switch")
        mark("train")
        engine_lp_all = torch.cat([r["engine_lp"] for r in all_local])
        all_ids = seqs_all.tolist()
        rewards = cfg.task.rewards([s[:P] for s in all_ids], [s[P:] for s in all_ids])
        adv_local = group_advantages(rewards, G)[rows].to(device)
        actor = trainer.actor
        with torch.no_grad():
            old_lp = trainer.token_logprobs(actor, batch, temperature=cfg.grpo.temperature)[:, P - 1:]
            raw_lp = old_lp if cfg.grpo.temperature == 1.0 else trainer.token_logprobs(actor, batch, temperature=1.0)[:, P - 1:]
        # The engine reports log-probs of the raw (temperature 1) distribution.
        gap = float((raw_lp.double().cpu() - engine_lp_all[rows]).abs().max())
        figures: dict[str, float] = {}

        def loss_fn() -> torch.Tensor:
            lp = trainer.token_logprobs(actor, batch, temperature=cfg.grpo.temperature)[:, P - 1:]
            loss, out = policy_loss(lp, old_lp, ref_lp, adv_local, clip_ratio=cfg.grpo.clip_ratio, kl_coef=cfg.grpo.kl_coef)
            figures.update(out)
            return loss

        for _ in range(cfg.grpo.ppo_epochs):
            trainer.step(loss_fn)
        mark("train")
        r_inf, r_tr = manager.last_reports[Direction.TO_INFER], manager.last_reports[Direction.TO_TRAIN]
        row = IterationStats(
            iteration=it,
            reward=float(rewards.mean()),
            kl=figures["kl"],
            clip_frac=figures["clip_frac"],
            logprob_gap=gap,
            to_infer_s=r_inf.seconds,
            to_train_s=r_tr.seconds,
            moved_nbytes=r_inf.copied_nbytes + r_tr.copied_nbytes,
            device_train_nbytes=r_inf.device_before_nbytes,
            device_infer_nbytes=r_inf.device_after_nbytes,
            ref_onload_s=ref_s,
            iter_s=time.perf_counter() - t_iter,
            device_unexplained_nbytes=None if r_inf.residency is None else r_inf.residency.unexplained_nbytes,
        )
        stats.append(row)
        if on_iteration is not None:
            on_iteration(row, samples)
    manager.close()
    return stats


def stats_dict(row: IterationStats) -> dict[str, Any]:
    """JSON-ready form of one row."""
    return asdict(row)
