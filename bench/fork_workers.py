"""What a trainer rank's start costs when its Ray worker is forked from a process that has already imported torch,
transformers and DeepSpeed, against the plain start (a fresh interpreter importing them): issue 52's largest lever.

    .venv/bin/python bench/fork_workers.py [--ranks 2] [--rounds 2] [--json out.json]

Measured first (a /proc sample of every process over a whole `make test`, 2 cores): starting actors is ~40 % of the
suite's CPU, and one tiny trainer rank costs ~10 s of CPU to get ready, ~8 s of it imports (torch ~2.7 s,
transformers' Llama ~5 s with torch.distributed.tensor, dynamo and accelerate under it). Ray starts every worker as a
new interpreter and has no fork server for them; reflow.infra.cluster.forkserver is one (its docstring says how it
works), which the test session's cluster uses; this bench starts actors through it and without.

Each round, alternating: `plain` (TrainerGroup.create as a run makes it), `runtime_env` (the same with a runtime_env
of one env var: what any runtime_env costs, setup_worker.py, so the fork's own gain is read against it too) and
`forked`. Each: the group's ranks to ready (joined, model built, DeepSpeed engine made) in wall seconds and in CPU
seconds of the whole machine (/proc/stat, run it on a quiet machine), and a digest of every rank's weights, which must
be the same in all three. Prints one line per run and `fork_workers: ...` with the medians and the ratios."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_s() -> float:
    fields = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="trainer ranks a group starts (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three variants, alternating (default 2)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from bench._common import demo_policy, git_commit, machine
    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import RankSettings
    from reflow.infra.cluster import forkserver
    from reflow.infra.cluster.ray_connect import _closed_local_cluster, inherited_by_workers
    from reflow.infra.cluster.ray_head import private_temp_dir, worker_pool_config

    work = Path(tempfile.mkdtemp(prefix="fork_workers_"))
    policy = demo_policy(work / "policy", hidden=32, layers=2, mlp=64)
    server = forkserver.start(work, watch=os.getpid())
    if not server.wait_ready(300):
        raise SystemExit(f"the fork server did not listen within 300 s (its log: {server.log})")
    try:  # the server goes with this process whatever happens
        tmp = private_temp_dir()
        _closed_local_cluster(tmp.parent)
        with inherited_by_workers({forkserver.ENV: server.path, "TOKENIZERS_PARALLELISM": "false"}):
            ray.init(num_cpus=8, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False,
                     _system_config=worker_pool_config(8))
        settings = RankSettings(precision="fp32", lr=1e-3, lr_schedule="constant", warmup_steps=0, total_steps=10,
                                weight_decay=0.01, grad_clip=1.0, micro_batch_size=2, threads=1, seed=0)
        variants = {"plain": None, "runtime_env": {"env_vars": {"REFLOW_BENCH": "1"}},
                    "forked": forkserver.runtime_env()}

        def digest(self) -> tuple[int, str]:
            import hashlib

            h = hashlib.sha256()
            for p in self.engine.module.parameters():
                h.update(p.detach().cpu().numpy().tobytes())
            return os.getpid(), h.hexdigest()[:16]

        runs: list[dict] = []
        for r in range(args.rounds):
            for name, runtime_env in variants.items():
                time.sleep(2)
                b0, w0 = busy_s(), time.perf_counter()
                group = TrainerGroup.create(args.ranks, f"bench-{name}-{r}", name, model_path=str(policy),
                                            settings=settings, runtime_env=runtime_env)
                wall, cpu = time.perf_counter() - w0, busy_s() - b0
                ranks = ray.get([a.__ray_call__.remote(digest) for a in group.actors])
                for a in group.actors:
                    ray.kill(a)
                run = {"variant": name, "round": r, "ready_s": round(wall, 2), "cpu_s": round(cpu, 2),
                       "digests": sorted({d for _, d in ranks}), "pids": [p for p, _ in ranks]}
                runs.append(run)
                print(f"{name:12s} round {r}: {args.ranks} ranks ready in {wall:5.1f} s, machine CPU {cpu:5.1f} s, "
                      f"weights {run['digests']}", flush=True)
    finally:
        ray.shutdown()
        server.stop()
    med = {name: {k: statistics.median(x[k] for x in runs if x["variant"] == name) for k in ("ready_s", "cpu_s")}
           for name in variants}
    same = len({d for x in runs for d in x["digests"]}) == 1
    summary = {"ranks": args.ranks, "rounds": args.rounds,
               **{f"{k}_{name}": v for name, m in med.items() for k, v in m.items()},
               "cpu_ratio_plain_over_forked": round(med["plain"]["cpu_s"] / med["forked"]["cpu_s"], 2),
               "ready_ratio_plain_over_forked": round(med["plain"]["ready_s"] / med["forked"]["ready_s"], 2),
               "cpu_saved_per_rank_s": round((med["plain"]["cpu_s"] - med["forked"]["cpu_s"]) / args.ranks, 2),
               "same_weights": same}
    print("fork_workers: " + " ".join(f"{k}={v}" for k, v in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs, "machine": machine(),
                                               "commit": git_commit()}, indent=1))
    if not same:
        raise SystemExit("the forked ranks built other weights than the plain ones")


if __name__ == "__main__":
    main()
