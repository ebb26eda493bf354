#!/usr/bin/env bash
# On the GPU machine (after the carried wheels, and .gpuwheels/trl/: trl, datasets, dill, multiprocess):
# the GPU demo through reflow's train flow, a resume of that run from its checkpoint, then TRL's
# GRPOTrainer from the same initial policy for the same wall-clock (bench/trl_baseline.py), both policies
# scored by one evaluator. Writes demo logs and trl.json under $OUT, then bench/results/gpu-loop.json's
# fields as one JSON line (`gpu-loop: {...}`).
#   bash bench/gpu_machine/compare.sh [iterations] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
iters=${1:-100}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
repo=$PWD
[ -e /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuwheels/trl/*.whl
exp=gpu-cmp-$(date +%H%M%S)
OUT=$out bash bench/gpu_machine/run.sh one "experiment=$exp" "num_iterations=$iters" "$@" >/dev/null
cp "$out/demo-one.log" "$out/demo-$exp.log"
grep '^demo:' "$out/demo-$exp.log"
OUT=$out bash bench/gpu_machine/run.sh one "experiment=$exp" "num_iterations=$((iters + 10))" --resume auto "$@" \
  >/dev/null || echo "resume: FAILED (see demo-one.log)"
grep -E '^demo:|resum' "$out/demo-one.log" | tail -3 || true
cd /tmp/gpurun
seconds=$(grep -o 'seconds=[0-9]*' "$out/demo-$exp.log" | tail -1 | cut -d= -f2)
ckpt=$(ls -d .reflow/runs/$exp/checkpoints/iter_$(printf %06d "$iters"))
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 "$repo/bench/trl_baseline.py" --policy .reflow/models/gpu-demo-policy --reflow-model "$ckpt/model" \
  --seconds "$seconds" --out "$out/trl.json" 2>&1 | grep -E '^trl:|Error|error' | tail -5
