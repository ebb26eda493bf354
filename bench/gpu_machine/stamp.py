"""Copy stdin to stdout, each line prefixed with `[seconds]` since T0 (epoch seconds, the first argument;
default: when this process started). run.sh and startup_profile.sh stamp a run's output with it, to see
where start-up time goes (bench/RESULTS.md 16, 18, 19)."""
import sys
import time

t0 = float(sys.argv[1]) if len(sys.argv) > 1 else time.time()
for line in sys.stdin:
    sys.stdout.write(f"[{time.time() - t0:7.1f}] {line}")
    sys.stdout.flush()
