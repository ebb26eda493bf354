#!/usr/bin/env bash
# On the GPU machine (after the carried wheels, and .gpuwheels/trl/: trl, datasets, dill, multiprocess):
# the GPU demo through reflow's train flow, a resume of that run from its checkpoint, then TRL's
# GRPOTrainer from the same initial policy for the same wall-clock (bench/trl_baseline.py), both policies
# scored by one evaluator. Writes demo logs and trl.json under $OUT, then bench/results/gpu-loop.json's
# fields as one JSON line (`gpu-loop: {...}`).
#   bash bench/gpu_machine/compare.sh [iterations] [overrides...]   # all three (over 10 minutes at 100)
#   STEP=reflow bash bench/gpu_machine/compare.sh 100; STEP=trl bash bench/gpu_machine/compare.sh
#     (two calls on one warm machine: the second reads what the first left in /tmp/gpurun/compare.env)
#   RESUME=0 skips the resume; CLOCK=command gives TRL its seconds from its process's start, as reflow's
#   seconds= counts its whole command (default CLOCK=training: from TRL's first step, TRL's start-up free)
#   TRL's budget is reflow's trained_s (command start to the training loop's end, the final policy: the final
#   save and eval after it are outside both clocks); UNTIL=command gives it reflow's whole command (seconds=)
#   EVALS=0 runs reflow without its evals before and during training (the one after the last iteration stays):
#   TRL evaluates nothing inside its clock, and one evaluator scores both policies afterwards anyway
set -euo pipefail
step=${STEP:-all}
cd "$(dirname "$0")/../.."
iters=${1:-100}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
repo=$PWD
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log"
[ -e /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpuwheels/trl/*.whl
if [ "$step" != trl ]; then
# The policy first (the demo would build it inside its timed run): `seconds=` is then start-up + training + evals.
[ -e /tmp/gpurun/.reflow/models/gpu-demo-policy/config.json ] || (mkdir -p /tmp/gpurun && cd /tmp/gpurun &&
  PYTHONPATH=/tmp/site python3 -m reflow.flows.cli bootstrap --size gpu --digits 3 --data-out '' \
    --out .reflow/models/gpu-demo-policy > "$out/bootstrap.json" 2>/dev/null)
exp=gpu-cmp-$(date +%H%M%S)
evals=(); [ "${EVALS:-1}" = 0 ] && evals=(eval.before_train=false eval.interval=null)
OUT=$out bash bench/gpu_machine/run.sh one "experiment=$exp" "num_iterations=$iters" "${evals[@]}" "$@" >/dev/null
cp "$out/demo-one.log" "$out/demo-$exp.log"
grep -E '^(\[ *[0-9.]+\] )?demo:' "$out/demo-$exp.log"
if [ "${RESUME:-1}" != 0 ]; then
OUT=$out bash bench/gpu_machine/run.sh one "experiment=$exp" "num_iterations=$((iters + 10))" "$@" --resume auto \
  >/dev/null || echo "resume: FAILED (see demo-one.log)"
grep -E 'demo:|resum' "$out/demo-one.log" | tail -3 || true
fi
seconds=$(grep -o ' seconds=[0-9]*' "$out/demo-$exp.log" | tail -1 | cut -d= -f2)
# trained_s: reflow's command start to its training loop's end (the final policy; its save and last eval
# follow, as TRL's save and scoring follow its budget). UNTIL=command gives TRL reflow's whole command instead.
trained=$(grep -o 'trained_s=[0-9]*' "$out/demo-$exp.log" | tail -1 | cut -d= -f2)
[ -n "$trained" ] && [ "${UNTIL:-trained}" = trained ] && seconds=$trained
printf 'exp=%s\niters=%s\nseconds=%s\n' "$exp" "$iters" "$seconds" > /tmp/gpurun/compare.env
fi
[ "$step" = reflow ] && exit 0
. /tmp/gpurun/compare.env
cd /tmp/gpurun
ckpt=$(ls -d .reflow/runs/$exp/checkpoints/iter_$(printf %06d "$iters"))
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 "$repo/bench/trl_baseline.py" --policy .reflow/models/gpu-demo-policy --reflow-model "$ckpt/model" \
  --seconds "$seconds" --clock "${CLOCK:-training}" --out "$out/trl.json" 2>&1 | grep -E '^trl:|Error|error' | tail -5
