"""How iteration metrics are shown (infra/store/metric_views.py, the curves image, the iteration's timer):
hand-made metric dicts with numbers that can be checked on paper. No Ray, no Prefect server."""
from __future__ import annotations

import base64
import io
import time

import pandas as pd
from PIL import Image

from reflow.flows.iteration import StageTimer
from reflow.infra.store import metric_views as views
from reflow.infra.store.plots import curves_png, data_uri

METRICS = {"zeta": 1.0, "time_train": 2.0, "entropy": 1.5, "reward_mean": 0.25, "time_generate": 1.0,
           "clip_frac": 0.1, "kl": 0.01, "loss": 0.5, "time_report": 0.5, "time_orchestration": 0.5,
           "time_iteration": 4.0}


def test_key_metrics_come_first_then_timings_then_the_rest():
    names = [k for k, _ in views.ordered(METRICS)]
    assert names == ["reward_mean", "loss", "kl", "entropy", "time_iteration",
                     "time_generate", "time_orchestration", "time_report", "time_train", "clip_frac", "zeta"]


def test_timing_shares_are_of_the_whole_iteration_and_sum_to_100():
    rows = views.timing_rows(METRICS)
    assert [(r["stage"], r["seconds"], r["share"]) for r in rows] == [
        ("train", 2.0, "50.0%"), ("generate", 1.0, "25.0%"), ("report", 0.5, "12.5%"), ("orchestration", 0.5, "12.5%")]
    assert sum(float(r["share"].rstrip("%")) for r in rows) == 100.0


def test_stage_timer_accounts_for_the_whole_iteration():
    """Stages + colocated hand-overs timed inside their tasks + orchestration (the rest) = the whole."""
    timer = StageTimer()
    with timer("generate"):
        time.sleep(0.05)
    time.sleep(0.03)  # between stages: task start-up, Prefect hand-offs
    with timer("report"):
        time.sleep(0.02)
    metrics = {"reward_mean": 1.0, "time_engines_release": 0.01}  # a hand-over its task timed
    metrics |= timer.totals(metrics)
    stages = ("time_generate", "time_report", "time_engines_release", "time_orchestration")
    assert abs(sum(metrics[k] for k in stages) - metrics["time_iteration"]) < 1e-9
    assert 0.02 <= metrics["time_orchestration"] < 0.03 + 0.05, metrics  # the 0.03 s gap, less the hand-over
    rows = views.timing_rows(metrics)
    assert {r["stage"] for r in rows} == {"generate", "report", "engines_release", "orchestration"}
    assert abs(sum(float(r["share"].rstrip("%")) for r in rows) - 100.0) < 0.3  # rounding to 0.1 % each


def test_summary_line_names_the_key_metrics_and_says_what_is_missing():
    line = views.summary_line(3, METRICS)
    assert line.startswith("iteration 3: reward 0.250 loss 0.5000 kl 0.0100 entropy 1.500 | 4.0 s (")
    assert "train 2.0 s" in line and "orchestration 0.5 s" in line
    assert views.summary_line(0, {"reward_mean": 1.0}) == "iteration 0: reward 1.000 loss n/a kl n/a entropy n/a | n/a s ()"


def test_last_eval_is_the_newest_point_of_every_set():
    evals = {0: {"heldout": {"pass@1": 0.4}}, 10: {"heldout": {"pass@1": 0.66}, "gsm": {"pass@1": 0.125}}}
    assert views.last_eval(evals) == "heldout 0.660 gsm 0.125 @ 10"
    assert views.last_eval({}) == ""


def test_curves_image_is_small_and_embedded_whole():
    table = pd.DataFrame({"iteration": [0, 1, 2], "reward_mean": [0.2, 0.3, 0.5]})
    png = curves_png(table, {"heldout": [(0, 0.4), (3, 0.6)]}, "exp")
    uri = data_uri(png)
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1]) == png
    assert Image.open(io.BytesIO(png)).size == (560, 320) and len(uri) < 100_000, (len(uri),)


def test_curves_markdown_has_the_image_and_one_row_per_policy_version_newest_first():
    table = pd.DataFrame({"iteration": [0, 1, 2], "reward_mean": [0.2, 0.3, 0.5], "loss": [0.1, 0.2, 0.3],
                          "time_iteration": [2.0, 2.5, 3.0]})
    md = views.curves_markdown("exp", "data:image/png;base64,AAAA", "file:///r/exp/plots/curves.png", table,
                               {"heldout": [(0, 0.4), (3, 0.6)]})
    lines = md.splitlines()
    assert "![reward and eval curves](data:image/png;base64,AAAA)" in lines
    header = lines.index("| policy version | heldout pass@1 | reward | loss | seconds |")
    # version v holds the policy iteration v-1 produced: its reward sits on row v; version 0 is the eval before training
    assert lines[header + 2:] == ["| 3 | 0.600 | 0.500 | 0.3000 | 3.0 |", "| 2 |  | 0.300 | 0.2000 | 2.5 |",
                                  "| 1 |  | 0.200 | 0.1000 | 2.0 |", "| 0 | 0.400 |  |  |  |"]
    assert "file://" not in md.split("\n\n")[1]  # the image itself never points at storage
