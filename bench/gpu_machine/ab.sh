#!/usr/bin/env bash
# On the GPU machine: the GPU demo (one GPU, configs/gpu-demo.yaml) with two builds of reflow in one lease,
# alternated A B B A on the same initial policy, to say whether a change made the loop slower. Each build runs
# its own wheel (and its own copy of the config). Carry .gpuwheels/1, /2, /3 over consecutive calls first
# (bench/gpu_machine/prepare.py), then .abwheels/a/ and .abwheels/b/ (one reflow wheel each, e.g.
# `git archive REV | tar -x -C DIR && pip wheel --no-deps --no-build-isolation DIR -w .abwheels/a`).
#   OUT=$OUT bash bench/gpu_machine/ab.sh [iterations] [overrides...]
# Writes $OUT/ab.json (each run's `demo:` figures, in order) and each run's log.
set -euo pipefail
cd "$(dirname "$0")/../.."
iters=${1:-100}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
repo=$PWD
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > /tmp/ab-install.log
use() {  # install build $1's reflow into /tmp/site, replacing whatever reflow is there
  rm -rf /tmp/site/reflow /tmp/site/reflow-*.dist-info
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$repo"/.abwheels/"$1"/*.whl
}
# The policy first, by build b, outside every timed run (the demo would build it inside its first one).
use b
[ -e /tmp/gpurun/.reflow/models/gpu-demo-policy/config.json ] || (mkdir -p /tmp/gpurun && cd /tmp/gpurun &&
  PYTHONPATH=/tmp/site python3 -m reflow.flows.cli bootstrap --size gpu --digits 3 --data-out '' \
    --out .reflow/models/gpu-demo-policy > /tmp/ab-bootstrap.json 2>/dev/null)
n=0; echo "[" > "$out/ab.json"
for v in a b b a; do
  n=$((n + 1)); use "$v"
  OUT=/tmp/ab-$v-$n REINSTALL_REFLOW= bash bench/gpu_machine/run.sh one "experiment=ab-$v-$n" "num_iterations=$iters" \
    eval.before_train=false eval.interval=null "$@" > /dev/null 2>&1 || echo "run $n ($v) failed" >&2
  cp /tmp/ab-$v-$n/demo-one.log "$out/demo-$n-$v.log" 2>/dev/null || true
  line=$(grep -E 'demo: (accuracy|per-iteration)' "$out/demo-$n-$v.log" | sed 's/^\[ *[0-9.]*\] //' | tr '\n' ' ' || true)
  [ $n -gt 1 ] && echo "," >> "$out/ab.json"
  python3 - "$v" "$n" "$line" >> "$out/ab.json" <<'EOF'
import json, re, sys
build, n, line = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fig = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", line)}
print(json.dumps({"build": build, "run": n, "line": line.strip(), **fig}))
EOF
  echo "$v (run $n): $line"
done
echo "]" >> "$out/ab.json"
