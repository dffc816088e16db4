"""PNG plots of a GRPO run: reward over iterations, device memory over time with the phases marked."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_rewards", "plot_memory"]

_PHASE_COLORS = {"train": "#cfe3ff", "infer": "#ffe2c4", "reference": "#d8f5d0", "switch": "#eeeeee"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt

    return plt


def plot_rewards(rewards: list[float], path: Path) -> Path:
    """Mean reward per iteration."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rewards)), rewards, marker="o", ms=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.set_title("GRPO on the counting task")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(samples: list[tuple[float, str, int]], path: Path, *, unit: int = 2**20) -> Path:
    """Device bytes over time; ``samples`` are ``(seconds, phase, bytes)`` with phase one of
    ``train``, ``switch``, ``infer``, ``reference``. Spans between samples are shaded by the phase of
    the sample that opens them."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    t = [s[0] for s in samples]
    y = [s[2] / unit for s in samples]
    for (t0, phase, _), (t1, _, _) in zip(samples, samples[1:]):
        ax.axvspan(t0, t1, color=_PHASE_COLORS.get(phase, "white"), lw=0)
    ax.step(t, y, where="post", color="black")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PHASE_COLORS.values()]
    ax.legend(handles, list(_PHASE_COLORS), loc="upper right", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("device MiB (rank 0)")
    ax.set_title("Device memory across iterations")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
