#!/usr/bin/env bash
# On the GPU machine: py-spy profiles of the trainer rank and the engine in the GPU demo's steady state,
# to see where an iteration's compute stages spend their time (carry .gpuwheels/pyspy with the last part).
#   bash bench/gpu_machine/profile.sh [seconds] [overrides...]
# Starts `run.sh one <overrides>`, waits for its 8th iteration, records both actors for `seconds`
# (raw collapsed stacks: $OUT/trainer.txt, $OUT/engine.txt), then lets the run finish.
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-15}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log"
spy=/tmp/site/bin/py-spy
[ -x $spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpuwheels/pyspy/*.whl
exp=prof-$(date +%H%M%S)
OUT=$out bash bench/gpu_machine/run.sh one "experiment=$exp" "$@" > "$out/profile-run.txt" 2>&1 &
run=$!
until [ "$(ls -d /tmp/gpurun/.reflow/runs/$exp/iterations/*/metrics.json 2>/dev/null | wc -l)" -ge 8 ]; do
  kill -0 $run 2>/dev/null || { echo "profile.sh: the run ended before its 8th iteration" >&2; tail -20 "$out/profile-run.txt"; exit 1; }
  sleep 1
done
trainer=$(pgrep -f '^ray::TrainerRank' | head -1); engine=$(pgrep -f '^ray::EmbeddedEngine' | head -1)
echo "trainer pid $trainer, engine pid $engine"
$spy record --nonblocking -r 200 -d "$secs" -f raw -o "$out/trainer.txt" --pid "$trainer" > /dev/null 2>&1 &
tp=$!
$spy record --nonblocking -r 200 -d "$secs" -f raw -o "$out/engine.txt" --pid "$engine" > /dev/null 2>&1
wait $tp || true
wait $run || echo "profile.sh: the run failed (see profile-run.txt)"
grep -E '^(\[ *[0-9.]+\] )?demo:' "$out/demo-one.log" || true
