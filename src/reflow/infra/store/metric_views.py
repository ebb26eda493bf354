"""How an iteration's metrics are shown: key metrics first, per-stage timings with their shares, the
one-line summary that goes into the logs and the terminal. Plain functions of the metric dict."""
from __future__ import annotations

import math

import pandas as pd

# First in every table, in this order; whatever else a run records follows (timings, then A-Z).
KEY_METRICS = ("reward_mean", "loss", "kl", "entropy", "time_iteration")


def ordered(metrics: dict[str, object]) -> list[tuple[str, object]]:
    """Key metrics first, then the timings, then the rest by name."""
    key = [(k, metrics[k]) for k in KEY_METRICS if k in metrics]
    rest = sorted((k, v) for k, v in metrics.items() if k not in KEY_METRICS)
    return key + [kv for kv in rest if kv[0].startswith("time_")] + [kv for kv in rest if not kv[0].startswith("time_")]


def timing_rows(metrics: dict[str, object]) -> list[dict[str, object]]:
    """One row per timed stage (every `time_*` but the whole iteration), each with its share of
    `time_iteration`. The stages and `time_orchestration` (the rest) add up to the whole iteration,
    so the shares sum to 100 % (up to rounding)."""
    whole = float(metrics["time_iteration"])  # type: ignore[arg-type]
    stages = {k[5:]: float(v) for k, v in metrics.items()  # type: ignore[arg-type]
              if k.startswith("time_") and k != "time_iteration"}
    return [{"stage": k, "seconds": round(v, 3), "share": f"{100 * v / whole:.1f}%" if whole > 0 else "n/a"}
            for k, v in stages.items()]


def _num(metrics: dict[str, object], key: str, fmt: str) -> str:
    v = metrics.get(key)
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def summary_line(iteration: int, metrics: dict[str, object]) -> str:
    """`iteration 3: reward 0.412 loss 0.0012 kl 0.0000 entropy 1.234 | 1.9 s (generate 0.4 s, ...)`"""
    stages = ", ".join(f"{r['stage']} {r['seconds']:.1f} s" for r in timing_rows(metrics)) \
        if "time_iteration" in metrics else ""
    return (f"iteration {iteration}: reward {_num(metrics, 'reward_mean', '.3f')} loss {_num(metrics, 'loss', '.4f')} "
            f"kl {_num(metrics, 'kl', '.4f')} entropy {_num(metrics, 'entropy', '.3f')} "
            f"| {_num(metrics, 'time_iteration', '.1f')} s ({stages})")


def last_eval(evals: dict[int, dict[str, dict]]) -> str:
    """`heldout 0.660 @ 10` for the newest eval point (every set), or '' before the first one."""
    if not evals:
        return ""
    version = max(evals)
    return " ".join(f"{name} {s['pass@1']:.3f}" for name, s in evals[version].items()) + f" @ {version}"


CURVE_COLUMNS = (("reward_mean", "reward", ".3f"), ("loss", "loss", ".4f"), ("kl", "KL", ".4f"),
                 ("entropy", "entropy", ".3f"), ("time_iteration", "seconds", ".1f"))


def curves_markdown(experiment: str, image_uri: str, url: str, table: pd.DataFrame,
                    curves: dict[str, list[tuple[int, float]]]) -> str:
    """The curves artifact: the image, then one row per policy version, newest first: eval pass@1 per
    set where evaluated, and the key metrics of the iteration that produced that version (v - 1)."""
    names = sorted(curves)
    evals = {(name, v): acc for name, points in curves.items() for v, acc in points}
    rows = {int(r["iteration"]) + 1: r for r in table.to_dict("records")} if not table.empty else {}
    cols = [c for c in CURVE_COLUMNS if c[0] in table.columns]
    lines = [f"# {experiment}: learning curves", "", f"![reward and eval curves]({image_uri})", "",
             f"The same plot in storage: `{url}`", "",
             "| policy version | " + " | ".join([f"{n} pass@1" for n in names] + [c[1] for c in cols]) + " |",
             "|---|" + "---|" * (len(names) + len(cols))]
    for v in sorted(set(rows) | {v for _, v in evals}, reverse=True):
        cells = [format(evals[(n, v)], ".3f") if (n, v) in evals else "" for n in names]
        cells += [_num(rows[v], key, fmt) if v in rows else "" for key, _, fmt in cols]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
