"""Whether workers forked from reflow's fork server can use the GPU, and what forking saves there.

cluster.fork_workers' auto leaves the fork server off where the actors use GPUs: the server imports DeepSpeed, whose
accelerator probe may touch the CUDA driver, and a process forked after a CUDA initialisation cannot use the GPU. This
checks it on the GPU machine without Ray (the server imports none; infra/cluster/forkserver.py): the real server
(MODULES) is started, then a probe runs through the client (as a Ray worker would start) and plainly, in turn: each
imports what a trainer rank imports, builds a CUDA tensor, multiplies, asks DeepSpeed's accelerator for its device,
and reports the seconds from its start to that result and its CPU seconds.

    PYTHONPATH=src:/tmp/site python3 bench/fork_gpu.py [--rounds 3] [--json out.json]

Prints one line a probe and a summary: `fork-gpu: {...}` (forked_ok: every forked probe computed on the GPU; the
ready seconds and CPU seconds, plain against forked, medians).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, resource, sys, time
t0 = float(sys.argv[1])
warm = "transformers.models.llama.modeling_llama" in sys.modules
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  what a trainer rank imports
from reflow.engines.train.ds_rank import import_deepspeed
import_deepspeed()
from deepspeed.accelerator import get_accelerator
x = torch.randn(2048, 2048, device="cuda")
y = float((x @ x).sum())
torch.cuda.synchronize()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"warm": warm, "device": torch.cuda.get_device_name(), "accelerator": get_accelerator().device_name(),
                  "finite": y == y, "ready_s": time.time() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "pid": os.getpid()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="probes of each kind, alternating (default 3)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from reflow.infra.cluster import forkserver

    work = Path(tempfile.mkdtemp(prefix="fork_gpu_"))
    probe = work / "probe.py"
    probe.write_text(PROBE)
    t0 = time.time()
    server = forkserver.start(work, watch=os.getpid())
    if not server.wait_ready(600):
        raise SystemExit(f"the fork server did not listen within 600 s (its log: {server.log})")
    server_s = time.time() - t0
    print(f"server ready in {server_s:.1f} s; its log: {server.log.read_text()[-500:]}", flush=True)
    client = forkserver.runtime_env()["py_executable"].split()
    runs = []
    try:
        for r in range(args.rounds):
            for kind in ("plain", "forked"):
                env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
                if kind == "forked":
                    env[forkserver.ENV] = server.path
                p = subprocess.run([*client, str(probe), repr(time.time())], env=env, capture_output=True, text=True,
                                   timeout=600)
                line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
                got = {"kind": kind, "round": r, "rc": p.returncode, **(json.loads(line) if line else {}),
                       **({"stderr": p.stderr[-1500:]} if p.returncode or line is None else {})}
                runs.append(got)
                print(json.dumps(got), flush=True)
    finally:
        server.stop()
    def median(kind: str, key: str) -> float | None:
        values = [x[key] for x in runs if x["kind"] == kind and key in x]
        return statistics.median(values) if values else None

    med = {k: {m: median(k, m) for m in ("ready_s", "cpu_s")} for k in ("plain", "forked")}
    forked = [x for x in runs if x["kind"] == "forked"]
    summary = {"forked_ok": bool(forked) and all(x["rc"] == 0 and x.get("warm") and x.get("finite") for x in forked),
               "plain_ok": all(x["rc"] == 0 for x in runs if x["kind"] == "plain"), "server_ready_s": round(server_s, 2),
               "median": med, "device": next((x.get("device") for x in runs if x.get("device")), None),
               "rounds": args.rounds}
    print("fork-gpu:", json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
