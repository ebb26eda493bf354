"""Same results before and after a refactor: every algorithm's flow path runs 3 iterations of a tiny demo and
the non-timing metrics of each iteration are written to a JSON file; `--compare A B` says where two such
files differ. Run it on the tree before a change and on the tree after it (same machine, same seeds).

    .venv/bin/python bench/refactor_parity.py --out /tmp/before.json      # on the old tree
    .venv/bin/python bench/refactor_parity.py --out /tmp/after.json       # on the new tree
    .venv/bin/python bench/refactor_parity.py --compare /tmp/before.json /tmp/after.json

The cases are tests/test_algorithms_e2e.py's (plus GRPO, the default) at its shape: one trainer rank, one
engine, 4 prompts x 4 samples of at most 4 tokens. Keys that measure time, speed or memory are left out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

sys.path.insert(0, str(C.ROOT))  # the cases are the e2e test's own (tests/ is a package of the checkout)
from tests.test_algorithms_e2e import CASES as E2E_CASES  # noqa: E402

CASES = {"grpo": [], **E2E_CASES}
# Keys that measure the machine, not the algorithm: durations, rates, memory, utilisation, versions of code.
TIMING = re.compile(r"(^|_)(s|ms|time|seconds|wait|per_s|tokens_per_s|samples_per_s|mfu|mem|memory|mib|gib|rss|"
                    r"peak|busy|idle|util|overhead|elapsed|latency|throughput|rate)($|_)|_s$|_ms$|^t_|timing|stage_")


def _kept(key: str) -> bool:
    return not TIMING.search(key)


def _config(policy: Path, root: Path, name: str, extra: list[str]):
    from reflow.infra.config.schema import load_config

    return load_config(None, [
        f"experiment=parity-{name}", f"model.path={policy}", "num_iterations=3", "eval.before_train=false",
        "data.num_train=64", "data.num_eval=8", "rollout.prompts_per_iteration=4", "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4", "trainer.num_ranks=1", "trainer.micro_batch_size=16", "trainer.lr=1e-3",
        "weight_sync.verify=sample", f"storage.root=file://{root}/runs", *extra])


def run(out: Path, names: list[str]) -> None:
    C.set_bench_env()
    work = Path(tempfile.mkdtemp(prefix="reflow-parity-"))
    os.environ["PREFECT_HOME"] = str(work / "prefect")
    from prefect.testing.utilities import prefect_test_harness

    from reflow.flows.train import train
    from reflow.rl.demo_policy import build_model, build_tokenizer, save_policy

    tok = build_tokenizer()
    policy = save_policy(build_model(tok, hidden=32, layers=2, heads=2, mlp=64, seed=0), tok, work / "policy")
    result: dict[str, list[dict[str, float]]] = {}
    with prefect_test_harness(server_startup_timeout=180):
        for name in names:
            t0 = time.perf_counter()
            summary = train(_config(policy, work, name, CASES[name]))
            result[name] = [{k: v for k, v in sorted(m.items()) if isinstance(v, (int, float)) and _kept(k)}
                            for m in summary["history"]]
            print(f"{name}: {len(result[name])} iterations, {len(result[name][-1])} metrics, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"wrote {out}")


def compare(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> int:
    """Lines for every metric that differs (or is missing on one side); 0 when none does. `ignore`: keys
    a change means to differ (say why where the comparison is reported)."""
    def kept(d: dict) -> dict:
        return {name: [{k: v for k, v in m.items() if k not in ignore} for m in ms] for name, ms in d.items()}

    left, right = kept(json.loads(a.read_text())), kept(json.loads(b.read_text()))
    diffs = []
    for name in sorted(set(left) | set(right)):
        la, rb = left.get(name, []), right.get(name, [])
        if len(la) != len(rb):
            diffs.append(f"{name}: {len(la)} iterations vs {len(rb)}")
        for i, (x, y) in enumerate(zip(la, rb)):
            for k in sorted(set(x) | set(y)):
                vx, vy = x.get(k), y.get(k)
                same = vx == vy or (isinstance(vx, float) and isinstance(vy, float) and math.isnan(vx) and math.isnan(vy))
                if not same:
                    diffs.append(f"{name} iteration {i}: {k} {vx!r} vs {vy!r}")
    compared = sum(len(m) for ms in left.values() for m in ms)
    skipped = f" ({', '.join(ignore)} left out)" if ignore else ""
    print("\n".join(diffs) if diffs else f"identical: {compared} metric values over {len(left)} algorithms{skipped}")
    return 1 if diffs else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write this run's metrics here")
    p.add_argument("--only", nargs="*", choices=list(CASES), default=list(CASES), help="algorithms to run")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two earlier outputs")
    p.add_argument("--ignore", nargs="*", default=[], metavar="KEY", help="with --compare: keys left out")
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare, ignore=tuple(args.ignore))
    if not args.out:
        p.error("give --out FILE (or --compare A B)")
    run(args.out, args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
