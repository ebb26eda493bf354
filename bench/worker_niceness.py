"""Ray's `worker_niceness` (its default 15: every task and actor process at nice 15) against the 0 that the
clusters reflow starts now use, on this machine, with and without other CPU load.

    .venv/bin/python bench/worker_niceness.py [--hogs 2] [--work-s 2]

For each niceness: a fresh local Ray cluster (num_cpus=2), one actor that spins `--work-s` seconds of CPU
(as measured on a quiet core by the same loop first), timed alone and then beside `--hogs` busy-looping
processes at nice 0 (other work on the host: a compile, a data loader, another job). Prints one line per case and
`worker_niceness: slowdown_under_load nice15=<x> nice0=<y>` (wall under load / wall alone)."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import ray


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x ^= i
    return x


def _hog() -> None:
    while True:
        pass


@ray.remote
class Worker:
    def nice(self) -> int:
        return os.nice(0)

    def spin(self, n: int) -> float:
        t0 = time.perf_counter()
        _spin(n)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=2, help="busy processes at nice 0 beside the actor (default 2)")
    ap.add_argument("--work-s", type=float, default=2.0, help="seconds of CPU the actor's task takes alone")
    a = ap.parse_args()
    t0 = time.perf_counter()
    _spin(1_000_000)
    n = int(1_000_000 * a.work_s / (time.perf_counter() - t0))
    slow = {}
    for niceness in (15, 0):
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 _system_config={"worker_niceness": niceness})
        w = Worker.remote()
        got = ray.get(w.nice.remote())
        ray.get(w.spin.remote(1000))
        alone = ray.get(w.spin.remote(n))
        hogs = [mp.Process(target=_hog, daemon=True) for _ in range(a.hogs)]
        for h in hogs:
            h.start()
        try:
            loaded = ray.get(w.spin.remote(n))
        finally:
            for h in hogs:
                h.kill()
        ray.shutdown()
        slow[niceness] = loaded / alone
        print(f"worker_niceness={niceness} (actor at nice {got}): alone {alone:.2f} s, beside {a.hogs} busy "
              f"processes {loaded:.2f} s ({slow[niceness]:.1f}x)", flush=True)
    print(f"worker_niceness: slowdown_under_load nice15={slow[15]:.1f} nice0={slow[0]:.1f} "
          f"(cpus={os.cpu_count()}, hogs={a.hogs}, work_s={a.work_s})")


if __name__ == "__main__":
    main()
