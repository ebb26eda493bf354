#!/usr/bin/env bash
# On the GPU machine: where the GPU demo's start-up goes (bench/RESULTS.md 19). Two short verbose runs of
# `reflow demo --gpu` (the real train flow), every output line stamped with the seconds since start:
#   1. under py-spy, which samples the command and every process it starts (Prefect's server, Ray's
#      processes, the trainer rank and the engine) for the first PROFILE_S seconds, idle threads
#      included: $OUT/startup-spy.txt.gz (py-spy's raw collapsed stacks, one line per stack and count,
#      child processes nested under their parents; ~50 MB before gzip, over what one call brings back);
#   2. the same again without py-spy (Python's, inductor's and the page caches now warm), for the plain
#      timeline.
#   bash bench/gpu_machine/startup_profile.sh [iterations] [overrides...]
# Carry .gpuwheels/tools (the py-spy binary) with the last part of the wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
iters=${1:-20}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log"
# install.sh gathers .gpuwheels/*/ (the reflow wheel too) on the first call; a later call may bring a new one
if ls .gpuwheels/reflow/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpuwheels/reflow/*.whl
fi
spy=$PWD/.gpuwheels/tools/py-spy stamp=$PWD/bench/gpu_machine/stamp.py
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_HOME=/tmp/prefect-home RAY_USAGE_STATS_ENABLED=0
mkdir -p /tmp/gpurun && cd /tmp/gpurun
[ -e .reflow/models/gpu-demo-policy/config.json ] || python3 -m reflow.flows.cli bootstrap --size gpu --digits 3 \
  --data-out '' --out .reflow/models/gpu-demo-policy > "$out/bootstrap.json" 2>/dev/null
args=(demo --gpu --verbose "num_iterations=$iters" checkpoint.save_interval=1000 eval.interval=1000 "$@")
t0=$(date +%s.%N)
python3 -m reflow.flows.cli "${args[@]}" experiment=su-spy > >(python3 -u "$stamp" "$t0" > "$out/startup-spy.log") 2>&1 &
pid=$!  # the command itself (its output goes through the stamping process)
"$spy" record --pid "$pid" --subprocesses --idle --nonblocking -r 50 -d "${PROFILE_S:-100}" -f raw \
  -o /tmp/startup-spy.txt > "$out/py-spy.log" 2>&1 || echo "py-spy failed: see py-spy.log"
wait "$pid" || echo "the profiled run failed: see startup-spy.log"
gzip -c /tmp/startup-spy.txt > "$out/startup-spy.txt.gz"
t0=$(date +%s.%N)
python3 -m reflow.flows.cli "${args[@]}" experiment=su-plain 2>&1 | python3 -u "$stamp" "$t0" > "$out/startup-plain.log"
grep -E 'demo:' "$out/startup-plain.log" || true
tar -czf "$out/startup-records.tgz" --exclude='checkpoints' --exclude='*.parquet' -C .reflow/runs .
