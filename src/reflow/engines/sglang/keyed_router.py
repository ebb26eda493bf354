"""`python -m reflow.engines.sglang.keyed_router <sglang-router flags>`: sglang-router's own launcher
(`sglang_router.launch_router`'s parse and launch) with `--api-key` taken from the first line of stdin.

sglang-router reads its key only from the command line, where any user of the node can read it
(/proc/<pid>/cmdline) until the binary renames its process; here it joins the argument list in memory.
"""
from __future__ import annotations

import sys


def main() -> None:
    key = sys.stdin.readline().strip()
    if not key:
        sys.exit("keyed_router: expected the API key on the first line of stdin")
    from sglang_router.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args([*sys.argv[1:], "--api-key", key]))


if __name__ == "__main__":
    main()
