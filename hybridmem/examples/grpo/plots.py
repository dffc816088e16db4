"""PNG plots of a GRPO run: reward over iterations, device memory over time with the phases marked."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_rewards", "plot_memory"]

_PHASE_COLORS = {"train": "#cfe3ff", "infer": "#ffe2c4", "reference": "#d8f5d0", "switch": "#eeeeee"}


def _pyplot():
    import matplotlib  # noqa: PLC0415 - matplotlib is optional

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib is optional

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


def plot_memory(samples: list[tuple[float, str, dict[str, int]]], path: Path, *, unit: int = 2**10) -> Path:
    """Device bytes over time, stacked by owner (train param, optimizer, engine weights, kv cache, ...).

    ``samples`` are ``(seconds, phase, bytes_by_owner)`` with phase one of ``train``, ``switch``,
    ``infer``, ``reference``; the phase of a sample is drawn as a band under the plot until the next one.
    """
    plt = _pyplot()
    fig, (ax, band) = plt.subplots(2, 1, figsize=(8, 4.2), sharex=True, height_ratios=(8, 1))
    t = [s[0] for s in samples]
    owners = [o for o in dict.fromkeys(o for s in samples for o in s[2])
              if any(s[2].get(o, 0) for s in samples)]
    ys = [[s[2].get(o, 0) / unit for s in samples] for o in owners]
    ax.stackplot(t, ys, labels=owners, step="post", alpha=0.85)
    ax.legend(loc="upper left", fontsize=7, ncol=3)
    ax.set_ylabel("device KiB (rank 0)")
    ax.set_title("Device memory by owner across iterations")
    for (t0, phase, _), (t1, _, _) in zip(samples, samples[1:]):
        band.axvspan(t0, t1, color=_PHASE_COLORS.get(phase, "white"), lw=0)
    band.set_yticks([])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PHASE_COLORS.values()]
    band.legend(handles, list(_PHASE_COLORS), loc="upper right", bbox_to_anchor=(1.0, -0.9), ncol=4,
                fontsize=7)
    band.set_xlabel("seconds", loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
