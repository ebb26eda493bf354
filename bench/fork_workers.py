"""What a trainer rank's start costs when its Ray worker is forked from a process that has already imported torch,
transformers and DeepSpeed, against the plain start (a fresh interpreter importing them): issue 52's largest lever.

    .venv/bin/python bench/fork_workers.py [--ranks 2] [--rounds 2] [--json out.json]

Measured first (a /proc sample of every process over a whole `make test`, 2 cores): starting actors is ~40 % of the
suite's CPU, and one tiny trainer rank costs ~10 s of CPU to get ready, ~8 s of it imports (torch ~2.7 s,
transformers' Llama ~5 s with torch.distributed.tensor, dynamo and accelerate under it). Ray starts every worker as a
new interpreter and has no fork server for them, so this bench makes one (a measurement, not yet reflow's code):

- a fork server imports reflow's trainer and engine modules, torch, transformers and DeepSpeed (not Ray: its C++
  core reads the worker's job id from the environment once, when it is loaded), then forks one child per request;
- the actor's `runtime_env={"py_executable": "<python> bench/fork_workers.py --client"}` makes the raylet run this file
  as the worker's interpreter: it hands the server its argv, environment, working folder and stdio, the server forks,
  and the child runs Ray's default_worker.py as __main__ with those. The client stays as the process the raylet
  started: it forwards signals and exits with the child's status; the child exits when the client goes (killed).

Each round, alternating: `plain` (TrainerGroup.create as a run makes it), `runtime_env` (the same with a runtime_env
of one env var: what any runtime_env costs, setup_worker.py, so the fork's own gain is read against it too) and
`forked`. Each: the group's ranks to ready (joined, model built, DeepSpeed engine made) in wall seconds and in CPU
seconds of the whole machine (/proc/stat, run it on a quiet machine), and a digest of every rank's weights, which must
be the same in all three. Prints one line per run and `fork_workers: ...` with the medians and the ratios."""
from __future__ import annotations

import sys

if len(sys.argv) > 1 and sys.argv[1] == "--client":  # the worker's interpreter: nothing heavy imported here
    import json
    import os
    import signal
    import socket

    argv = sys.argv[2:]
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(os.environ["REFLOW_BENCH_FORK_SERVER"])
    except (KeyError, OSError):  # no server: start as Ray would have
        os.execv(sys.executable, [sys.executable, *argv])
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    answers = conn.makefile("r")
    child = json.loads(answers.readline())["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda num, _frame: os.kill(child, num))
    line = answers.readline()
    sys.exit(json.loads(line)["status"] if line else 1)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def serve(path: str) -> None:
    """The fork server: import, listen, fork a worker per request; report each child's exit to its client."""
    t0 = time.process_time()
    import torch  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import reflow.engines.embedded.engine  # noqa: F401
    import reflow.engines.train.trainer  # noqa: F401
    from reflow.engines.train.ds_rank import import_deepspeed

    import_deepspeed()
    assert "ray._raylet" not in sys.modules, "Ray's core must load in the worker, after its environment is set"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print(json.dumps({"ready": True, "import_cpu_s": round(time.process_time() - t0, 2)}), flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([server], [], [], 0.2)
        while children:  # reap without threads: a fork while another thread holds a lock could inherit it held
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
        if not readable:
            continue
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            _become_worker(server, conn, fds, request)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn


def _become_worker(server: socket.socket, conn: socket.socket, fds: list[int], request: dict) -> None:
    import random
    import runpy
    import threading

    server.close()
    conn.close()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()  # every child would otherwise draw the server's sequence
    client = os.pidfd_open(request["client"])

    def client_gone() -> None:  # the raylet killed the process it started: this one goes with it
        select.select([client], [], [])
        os._exit(1)

    threading.Thread(target=client_gone, daemon=True).start()
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(sys.argv[0])  # as `python default_worker.py` would have it
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        os._exit(e.code if isinstance(e.code, int) else 0)
    os._exit(0)


def busy_s() -> float:
    fields = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="trainer ranks a group starts (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three variants, alternating (default 2)")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from bench._common import demo_policy, git_commit, machine
    from reflow.engines.train.group import TrainerGroup
    from reflow.engines.train.settings import RankSettings
    from reflow.infra.cluster.ray_connect import _closed_local_cluster, inherited_by_workers
    from reflow.infra.cluster.ray_head import private_temp_dir, worker_pool_config

    work = Path(tempfile.mkdtemp(prefix="fork_workers_"))
    policy = demo_policy(work / "policy", hidden=32, layers=2, mlp=64)
    sock = str(work / "fork.sock")
    server = subprocess.Popen([sys.executable, __file__, "--serve", sock], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    try:  # the server goes with this process whatever happens (it holds our stdout and stderr)
        started = {}
        for line in server.stdout:  # DeepSpeed prints a warning on stdout as it is imported
            if line.startswith('{"ready"'):
                started = json.loads(line)
                break
        if not started:
            raise SystemExit(f"the fork server exited before it was ready (status {server.wait()})")
        tmp = private_temp_dir()
        _closed_local_cluster(tmp.parent)
        with inherited_by_workers({"REFLOW_BENCH_FORK_SERVER": sock, "TOKENIZERS_PARALLELISM": "false"}):
            ray.init(num_cpus=8, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False,
                     _system_config=worker_pool_config(8))
        settings = RankSettings(precision="fp32", lr=1e-3, lr_schedule="constant", warmup_steps=0, total_steps=10,
                                weight_decay=0.01, grad_clip=1.0, micro_batch_size=2, threads=1, seed=0)
        variants = {"plain": None, "runtime_env": {"env_vars": {"REFLOW_BENCH": "1"}},
                    "forked": {"py_executable": f"{sys.executable} {__file__} --client"}}

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
        server.kill()
    med = {name: {k: statistics.median(x[k] for x in runs if x["variant"] == name) for k in ("ready_s", "cpu_s")}
           for name in variants}
    same = len({d for x in runs for d in x["digests"]}) == 1
    summary = {"ranks": args.ranks, "rounds": args.rounds, "server_import_cpu_s": started["import_cpu_s"],
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
