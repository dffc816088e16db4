"""Rank 0's view of a GRPO run: progress bar, per-iteration table, summary, plots and JSON log."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from hybridmem.examples.grpo.loop import DemoConfig, IterationStats
from hybridmem.switch.memplan import format_nbytes

__all__ = ["RankZeroReporter"]

_COLUMNS = ("iter", "reward", "KL", "lp gap", "to INFER ms", "to TRAIN ms", "ref ms", "moved", "dev TRAIN",
            "dev INFER", "iter s")


class RankZeroReporter:
    """Collects rank 0's iteration figures and renders them (PNG plots only with ``plots``: they need
    matplotlib)."""

    def __init__(self, cfg: DemoConfig, out: Path, *, plots: bool = True):
        self.cfg = cfg
        self.out = out
        self.plots = plots
        self.console = Console(width=max(Console().width, 132))  # the table is 124 columns wide
        layout = f"train {cfg.hybrid.train_layout}, infer {cfg.hybrid.infer_layout}"
        self.console.print(f"[bold]hybridmem GRPO demo[/]: {cfg.trainer} trainer, {layout}, "
                           f"{cfg.hybrid.device}")
        self.bar = tqdm(total=cfg.iters, desc="GRPO", unit="iter")
        self.samples: list[tuple[float, str, dict[str, int]]] = []
        self.ends: list[int] = []
        """``len(samples)`` at the end of each iteration."""

    def on_iteration(self, row: IterationStats, samples: list[tuple[float, str, dict[str, int]]]) -> None:
        self.samples = list(samples)
        self.ends.append(len(samples))
        self.bar.set_postfix(reward=f"{row.reward:.3f}", kl=f"{row.kl:.3f}")
        self.bar.update(1)

    def _table(self, stats: list[IterationStats]) -> Table:
        table = Table(title="per-iteration figures (rank 0)")
        for c in _COLUMNS:
            table.add_column(c, justify="right")
        for r in stats:
            table.add_row(
                str(r.iteration), f"{r.reward:.3f}", f"{r.kl:.4f}", f"{r.logprob_gap:.1e}",
                f"{r.to_infer_s * 1e3:.1f}", f"{r.to_train_s * 1e3:.1f}", f"{r.ref_onload_s * 1e3:.1f}",
                format_nbytes(r.moved_nbytes), format_nbytes(r.device_train_nbytes),
                format_nbytes(r.device_infer_nbytes), f"{r.iter_s:.2f}",
            )
        return table

    def finish(self, stats: list[IterationStats], *,
               workers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Print the table and summary, write the plots and ``grpo.json`` (with ``workers``, where each
        worker ran, when given); returns the summary."""
        self.bar.close()
        self.console.print(self._table(stats))
        rewards = [r.reward for r in stats]
        k = min(5, len(rewards))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        self.out.mkdir(parents=True, exist_ok=True)
        begin = self.ends[-4] if len(self.ends) >= 4 else 0  # the last 3 iterations
        plots = []
        if self.plots:
            from hybridmem.examples.grpo.plots import plot_memory, plot_rewards  # noqa: PLC0415 - needs matplotlib

            plots = [
                plot_rewards(rewards, self.out / "reward.png"),
                plot_memory(self.samples[begin:], self.out / "memory.png"),
            ]
        summary = {
            "first5_reward": first,
            "last5_reward": last,
            "max_logprob_gap": max(r.logprob_gap for r in stats),
            "iterations": [asdict(r) for r in stats],
            "memory_samples": self.samples,
            **({"workers": workers} if workers is not None else {}),
        }
        (self.out / "grpo.json").write_text(json.dumps(summary, indent=1))
        self.console.print(f"mean reward, first {k} iterations: [bold]{first:.3f}[/]; "
                           f"last {k}: [bold]{last:.3f}[/]")
        self.console.print(f"max |engine - actor| log-prob over sampled tokens: "
                           f"{summary['max_logprob_gap']:.2e}")
        if workers:
            nodes = {w["node_id"] for w in workers}
            self.console.print(f"Ray: {len(workers)} worker actors on {len(nodes)} node(s): " + ", ".join(
                f"rank {w['rank']} pid {w['pid']} node {w['node_id'][:8]}" for w in workers))
        self.console.print("wrote " + ", ".join(str(p) for p in [*plots, self.out / "grpo.json"]))
        return summary

