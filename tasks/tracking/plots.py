"""Step curves as a figure (matplotlib) for a run's artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Reward, held-out accuracy, KL and completion length per step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo.eval.selection import SELECT_KEY, curve_key

    key = curve_key(rows)
    accuracy = ("selection split accuracy (greedy)" if key == SELECT_KEY
                else "in-run held-out subset accuracy (greedy)")  # fmt: skip
    panels = [
        ("reward", "reward"),
        (key, accuracy),
        ("kl", "KL to reference"),
        ("completions/mean_length", "completion length"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, (key, label) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            note = "beta = 0: no reference, no KL" if key == "kl" else "not logged"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        elif len(pts) < 20:
            ax.plot(*zip(*pts), marker="o")
        else:  # noisy per-step values: faint raw curve, moving average on top
            xs, ys = zip(*pts)
            w = max(1, len(ys) // 20)
            avg = [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1])
                   for i in range(len(ys))]  # fmt: skip
            ax.plot(xs, ys, alpha=0.3)
            ax.plot(xs, avg, label=f"mean of {w}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
