"""Reward and eval curves of an experiment, drawn from its records in storage."""
from __future__ import annotations

import base64
import io

import pandas as pd

# The PNG travels inside a markdown artifact (a data: URI), so it stays small: ~560x320 px, ~25 kB.
DPI = 80


def data_uri(png: bytes) -> str:
    """A `data:` URI: the Prefect UI renders it in a markdown artifact with no access to the storage
    (a browser cannot load file:// or s3:// images from a web page)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def curves_png(table: pd.DataFrame, evals: dict[str, list[tuple[int, float]]], title: str, dpi: int = DPI) -> bytes:
    """PNG bytes: mean rollout reward per iteration, and one curve per eval set (its pass@1 at each
    eval point; `evals` maps set name -> [(policy version, pass@1)]).

    Iteration i's reward is plotted at x = i + 1 (the policy version its update produced), so both
    curves share the policy-version axis and the eval before training sits at x = 0.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=dpi)
    if not table.empty and "reward_mean" in table.columns:
        ax.plot(table["iteration"] + 1, table["reward_mean"], lw=1.2, label="mean rollout reward")
    for name, points in evals.items():
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, "o-", lw=1.5, label=f"eval {name}: pass@1")
    ax.set_xlabel("policy version (iterations trained)")
    ax.set_ylabel("reward / pass@1")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
