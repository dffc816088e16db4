"""The demo's integrated worker for Ray (``hybridmem demo --launcher ray``): one actor per device holding the
actor's trainer rank, its rollout engine, its ShardingManager and the co-resident reference and reward
models, with the methods MindSpeed-RL's ``ActorHybridWorker`` and verl's workers expose.

Each method runs in the phase its task needs: :meth:`HybridActorWorker.generate_sequences` inside
``manager.inference()`` (TRAIN -> INFER and back in the one call), the others in TRAIN, the reference
and the reward model onloaded for their own task alone. The arithmetic is :class:`GRPORank`'s, the
one-process-per-rank demo's, so the two launchers give the same rewards from the same seeds.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from hybridmem.examples.grpo.loop import DemoConfig, GRPORank, IterationStats
from hybridmem.integrations.ray import HybridWorker

__all__ = ["HybridActorWorker"]


class HybridActorWorker(HybridWorker):
    """One rank of the demo in a Ray actor (see the module docstring); :meth:`setup` builds it after the
    group has joined the process group."""

    rank_state: GRPORank

    def setup(self, cfg: DemoConfig) -> dict[str, Any]:
        """Build the trainer, engine, manager and co-resident models from ``cfg``; returns where this actor
        runs (:meth:`placement`)."""
        warnings.filterwarnings("ignore", module=r"megatron\.")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
        torch.set_num_threads(1)
        if cfg.engine in ("vllm", "vllm-server"):
            from hybridmem.examples.grpo.engines import vllm_env  # noqa: PLC0415

            env = vllm_env(self.rank, self.world_size, cfg.hybrid.infer_layout.tp,
                           int(os.environ["MASTER_PORT"]), own_process=cfg.engine == "vllm-server")
            for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # the group's, set when joining
                env.pop(key)
            os.environ.update(env)
        self.rank_state = GRPORank(cfg)
        return self.placement()

    def generate_sequences(self, it: int) -> dict[str, torch.Tensor]:
        """Iteration ``it``'s rollouts of this rank's inference replica (TRAIN -> INFER, sample,
        INFER -> TRAIN)."""
        rank = self.rank_state
        rank.mark("train")
        rank.mark("switch")
        with rank.manager.inference() as engine:
            rank.mark("infer")
            out = rank.sample(engine, it)
            rank.mark("switch")
        rank.mark("train")
        return out

    def compute_ref_log_prob(self, batch: torch.Tensor) -> torch.Tensor:
        """The reference's log-probs of ``batch``'s completion tokens (the reference onloaded for this)."""
        return self.rank_state.compute_ref_log_prob(batch)

    def compute_rm_score(self, seqs: torch.Tensor) -> torch.Tensor:
        """The reward model's score of each of ``seqs`` (the reward model onloaded for this)."""
        return self.rank_state.compute_rm_score(seqs)

    def compute_log_prob(self, batch: torch.Tensor, engine_lp: torch.Tensor) -> torch.Tensor:
        """The actor's log-probs of ``batch``'s completion tokens before the update."""
        return self.rank_state.compute_log_prob(batch, engine_lp=engine_lp)

    def update(self, batch: torch.Tensor, old_lp: torch.Tensor, ref_lp: torch.Tensor,
               advantages: torch.Tensor) -> dict[str, float]:
        """The clipped-policy steps on this rank's share ``batch``; returns the last step's figures."""
        return self.rank_state.update(batch, old_lp, ref_lp, advantages)

    def iteration_stats(self, it: int, reward: float, iter_s: float) -> tuple[IterationStats, list[Any]]:
        """This rank's row of iteration ``it`` and its memory samples so far."""
        return (self.rank_state.iteration_stats(it, reward=reward, iter_s=iter_s),
                list(self.rank_state.samples))

    def teardown(self) -> None:
        """Close the manager, the trainer and the engine, then leave the process group."""
        rank = getattr(self, "rank_state", None)
        if rank is not None:
            rank.manager.close()
            rank.close()
        self.leave()
