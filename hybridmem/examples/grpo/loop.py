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
from hybridmem.examples.grpo.reward import CountRewardModel
from hybridmem.examples.grpo.task import CountTask
from hybridmem.examples.grpo.topology import Topology, build_topology
from hybridmem.examples.grpo.trainers import build_trainer
from hybridmem.reshard.spec import ModelSpec

__all__ = ["DemoConfig", "GRPORank", "IterationStats", "REWARDS", "rule_rewards", "run_rank"]

REWARDS = ("rule", "model")
"""How rollouts are scored: the task's rule, or a reward model co-resident on the devices."""


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
    reward: str = "rule"
    """``rule`` (the task's reward function) or ``model`` (:class:`CountRewardModel`, a network co-resident
    on the devices, onloaded only to score)."""

    def __post_init__(self) -> None:
        if self.model.vocab_size != self.task.vocab_size:
            raise ValueError(f"model vocab_size={self.model.vocab_size} differs from task "
                             f"vocab_size={self.task.vocab_size}")
        if self.iters < 1 or self.num_prompts < 1:
            raise ValueError(f"iters={self.iters} and num_prompts={self.num_prompts} must be >= 1")
        if self.trainer not in ("torch", "megatron", "fsdp"):
            raise ValueError(f"trainer={self.trainer!r}; expected 'torch', 'megatron' or 'fsdp'")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}; expected one of {ENGINES}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward={self.reward!r}; expected one of {REWARDS}")


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
    rank = GRPORank(cfg)
    try:
        # The ranks end their setup at different moments (model, engine, manager); without this the first
        # switch's time would include the wait for the slowest rank inside the weight sync's collectives.
        dist.barrier()
        stats = []
        for it in range(cfg.iters):
            stats.append(_iteration(rank, it))
            if on_iteration is not None:
                on_iteration(stats[-1], rank.samples)
        rank.manager.close()
        return stats
    finally:
        rank.close()


def _iteration(rank: GRPORank, it: int) -> IterationStats:
    """One iteration in one process per rank: the rollouts are gathered over the process group, and the
    reference (and reward model) score them beside the engine while the actor's state is on the host."""
    cfg, topo = rank.cfg, rank.topo
    t_iter = time.perf_counter()
    rank.mark("train")
    rank.mark("switch")
    with rank.manager.inference() as eng:
        rank.mark("infer")
        all_local = _gather_rollouts(rank.sample(eng, it), topo)
        seqs_all = torch.cat([r["seqs"] for r in all_local])
        rows = topo.train_rows
        ref_lp = rank.compute_ref_log_prob(seqs_all[rows])
        rewards = rank.compute_rm_score(seqs_all) if cfg.reward == "model" else None
        rank.mark("switch")
    rank.mark("train")
    if rewards is None:
        rewards = rule_rewards(cfg, seqs_all)
    adv = group_advantages(rewards, cfg.grpo.group_size)
    engine_lp_all = torch.cat([r["engine_lp"] for r in all_local])
    old_lp = rank.compute_log_prob(seqs_all[rows], engine_lp=engine_lp_all[rows])
    rank.update(seqs_all[rows], old_lp, ref_lp, adv[rows])
    return rank.iteration_stats(it, reward=float(rewards.mean()), iter_s=time.perf_counter() - t_iter)


def rule_rewards(cfg: DemoConfig, seqs: torch.Tensor) -> torch.Tensor:
    """The task's rule reward of every sequence (prompt and completion tokens)."""
    P = cfg.task.prompt_len
    ids = seqs.tolist()
    return cfg.task.rewards([s[:P] for s in ids], [s[P:] for s in ids])


class GRPORank:
    """One rank of the demo: its trainer (actor and reference), engine, manager (and reward model), with
    one method per task of a GRPO iteration, the names MindSpeed-RL's and verl's workers use.

    The one-process-per-rank loop (:func:`run_rank`) and the Ray worker
    (:class:`hybridmem.examples.grpo.ray_worker.HybridActorWorker`) both call these methods, so the two
    launchers compute the same numbers from the same seeds.

    Args:
        cfg: The run (``torch.distributed`` initialised with the run's world size).
    """

    def __init__(self, cfg: DemoConfig):
        self.cfg = cfg
        self.topo = build_topology(cfg.hybrid.train_layout, cfg.hybrid.infer_layout)
        torch.manual_seed(cfg.seed)
        self.device = torch.device("cpu" if cfg.hybrid.device in ("auto", "cpu") else cfg.hybrid.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.trainer = build_trainer(cfg.trainer, cfg.model, self.topo, seed=cfg.seed, lr=cfg.grpo.lr,
                                     dtype=self.dtype, device=self.device)
        self.engine: Any = None
        self.samples: list[tuple[float, str, dict[str, int]]] = []
        """``(seconds since start, phase, device bytes by owner)`` at each phase of each iteration."""
        self.ref_s = 0.0
        self.gap = 0.0
        self.figures: dict[str, float] = {}
        self._start = time.perf_counter()
        try:
            max_len = cfg.task.prompt_len + cfg.task.completion_len
            seqs_per_replica = -(-cfg.num_prompts // self.topo.num_infer_replicas) * cfg.grpo.group_size
            # Built released: the manager starts in TRAIN with the engine's memory released.
            self.engine = build_engine(cfg.engine, cfg.model, self.topo, device=self.device, dtype=self.dtype,
                                       max_len=max_len, max_seqs=seqs_per_replica)
            self.manager = self._manager()
            self.manager.add_coresident("reference", self.trainer.reference)
            if cfg.reward == "model":
                self.manager.add_coresident("reward", CountRewardModel(cfg.task, device=self.device))
        except BaseException:
            self.close()
            raise

    def _manager(self) -> ShardingManager:
        from hybridmem.weight_sync import ReshardSync  # noqa: PLC0415

        cfg, trainer = self.cfg, self.trainer
        if cfg.trainer == "fsdp":  # the user's path: the manager finds the FSDP2 shards and reshards them
            return ShardingManager(trainer.training, self.engine, optimizer=trainer.optimizer,
                                   config=cfg.hybrid, model_spec=trainer.hf_config)
        sync = ReshardSync(
            cfg.model,
            src=cfg.hybrid.train_layout,
            dst=cfg.hybrid.infer_layout,
            group=None,
            source=trainer.named_weights,
            engine=self.engine,
            bucket_nbytes=cfg.hybrid.reshard_bucket_bytes,
            verify=cfg.hybrid.verify_weight_sync,
            dtype=self.dtype,
            megatron=trainer.megatron_convention(),
        )
        # else None: a MegatronTrainingState carries its own
        optimizer = trainer.optimizer if trainer.training is trainer.actor else None
        manager = ShardingManager(trainer.training, self.engine, optimizer=optimizer, config=cfg.hybrid,
                                  weight_sync=sync)
        trainer.attach(manager)
        return manager

    def mark(self, phase: str) -> None:
        """Record the device bytes by owner now, labelled ``phase``."""
        self.samples.append((time.perf_counter() - self._start, phase,
                             dict(self.manager.residency().by_owner)))

    def sample(self, engine: Any, it: int) -> dict[str, torch.Tensor]:
        """This inference replica's rollouts of iteration ``it`` (in INFER): ``group_size`` completions of
        each of its prompts, with the engine's log-probs of the sampled tokens (temperature 1)."""
        from hybridmem.engines import SamplingParams  # noqa: PLC0415

        cfg, topo = self.cfg, self.topo
        prompts = cfg.task.prompts(cfg.num_prompts, seed=cfg.seed * 100_003 + it)
        mine = prompts[topo.infer_replica::topo.num_infer_replicas]
        outs = engine.generate(
            [p for p in mine for _ in range(cfg.grpo.group_size)],
            SamplingParams(max_tokens=cfg.task.completion_len, temperature=cfg.grpo.temperature,
                           seed=cfg.seed * 7919 + it * 31 + topo.infer_replica, logprobs=True),
        )
        return {"seqs": torch.tensor([o.prompt_ids + o.token_ids for o in outs], dtype=torch.long),
                "engine_lp": torch.tensor([o.logprobs for o in outs], dtype=torch.float64)}

    def compute_ref_log_prob(self, batch: torch.Tensor) -> torch.Tensor:
        """The reference policy's log-probs of ``batch``'s completion tokens, the reference onloaded for
        this alone."""
        P = self.cfg.task.prompt_len
        t_ref = time.perf_counter()
        with self.manager.onloaded("reference") as ref, torch.no_grad():
            self.mark("reference")
            out = self.trainer.token_logprobs(ref, batch.to(self.device),
                                              temperature=self.cfg.grpo.temperature)[:, P - 1:]
        self.ref_s = time.perf_counter() - t_ref
        return out

    def compute_rm_score(self, seqs: torch.Tensor) -> torch.Tensor:
        """The reward model's score of each sequence, the reward model onloaded for this alone."""
        with self.manager.onloaded("reward") as rm, torch.no_grad():
            self.mark("reward")
            return rm(seqs.to(self.device)).cpu()

    def compute_log_prob(self, batch: torch.Tensor, *, engine_lp: torch.Tensor) -> torch.Tensor:
        """The actor's log-probs of ``batch``'s completion tokens before the update (the ratio's
        denominator), and the largest gap to the engine's log-probs of the same tokens ``engine_lp``
        (kept for :meth:`iteration_stats`: the two layouts hold the same weights, so they agree to float
        rounding)."""
        P, temperature = self.cfg.task.prompt_len, self.cfg.grpo.temperature
        actor, batch = self.trainer.actor, batch.to(self.device)
        with torch.no_grad():
            old_lp = self.trainer.token_logprobs(actor, batch, temperature=temperature)[:, P - 1:]
            # The engine reports log-probs of the raw (temperature 1) distribution.
            raw_lp = (old_lp if temperature == 1.0
                      else self.trainer.token_logprobs(actor, batch, temperature=1.0)[:, P - 1:])
        self.gap = float((raw_lp.double().cpu() - engine_lp).abs().max())
        return old_lp

    def update(self, batch: torch.Tensor, old_lp: torch.Tensor, ref_lp: torch.Tensor,
               advantages: torch.Tensor) -> dict[str, float]:
        """``ppo_epochs`` clipped-policy steps on ``batch``; returns the last step's figures (``kl``,
        ``clip_frac``)."""
        P, g = self.cfg.task.prompt_len, self.cfg.grpo
        actor, batch, adv = self.trainer.actor, batch.to(self.device), advantages.to(self.device)
        figures: dict[str, float] = {}

        def loss_fn() -> torch.Tensor:
            lp = self.trainer.token_logprobs(actor, batch, temperature=g.temperature)[:, P - 1:]
            loss, out = policy_loss(lp, old_lp, ref_lp.to(self.device), adv, clip_ratio=g.clip_ratio,
                                    kl_coef=g.kl_coef)
            figures.update(out)
            return loss

        for _ in range(g.ppo_epochs):
            self.trainer.step(loss_fn)
        self.mark("train")
        self.figures = figures
        return figures

    def iteration_stats(self, it: int, *, reward: float, iter_s: float) -> IterationStats:
        """Iteration ``it``'s row: its mean reward, the last update's figures, this rank's last switches,
        the iteration's seconds ``iter_s``."""
        figures = self.figures
        r_inf, r_tr = (self.manager.last_reports[Direction.TO_INFER],
                       self.manager.last_reports[Direction.TO_TRAIN])
        return IterationStats(
            iteration=it,
            reward=reward,
            kl=figures["kl"],
            clip_frac=figures["clip_frac"],
            logprob_gap=self.gap,
            to_infer_s=r_inf.seconds,
            to_train_s=r_tr.seconds,
            moved_nbytes=r_inf.copied_nbytes + r_tr.copied_nbytes,
            device_train_nbytes=r_inf.device_before_nbytes,
            device_infer_nbytes=r_inf.device_after_nbytes,
            ref_onload_s=self.ref_s,
            iter_s=iter_s,
            device_unexplained_nbytes=None if r_inf.residency is None else r_inf.residency.unexplained_nbytes,
        )

    def close(self) -> None:
        """Tear down the trainer and the engine (vLLM's engine core: its cleanup also destroys the default
        process group)."""
        self.trainer.close()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


def stats_dict(row: IterationStats) -> dict[str, Any]:
    """JSON-ready form of one row."""
    return asdict(row)
