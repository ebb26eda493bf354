#!/usr/bin/env bash
# On the GPU machine (after the carried wheels, .gpuwheels/1, 2, 3 and reflow, and .gpuwheels/trl/: trl, datasets,
# dill, multiprocess, xxhash): issue 56's pair on the long-response task. The scratchpad policy is bootstrapped once,
# outside both clocks (`reflow bootstrap --task scratchpad --size gpu` in /tmp/gpurun: the policy, the train and
# held-out files, and bootstrap.json with the policy's held-out accuracy), then `reflow demo --gpu --task scratchpad`
# (configs/gpu-scratchpad.yaml) runs [iterations] through run.sh, then TRL's GRPOTrainer from the same initial policy
# for reflow's trained seconds (bench/trl_baseline.py --task scratchpad: the same files, reward function, group size,
# batch and lr), and one evaluator (rl/scratchpad_demo.accuracy) scores both final policies. Writes the demo log,
# trl-scratchpad.json / .log and gpu-long-task.json under $OUT, and prints bench/results/gpu-long-task.json's fields
# as one JSON line (`gpu-long-task: {...}`): gain (reflow's accuracy after, less the initial policy's from
# bootstrap.json: the same evaluator over the same held-out file), seconds (the clock both got), reflow_accuracy,
# trl_accuracy, reflow_samples_per_s (the demo: line), trl_samples_per_s, mean_response_tokens (reflow's rollouts:
# response tokens / samples over its iterations; TRL's beside it as trl_mean_response_tokens).
# Measured (bench/RESULTS.md 44, 45; an H100): the install ~60-90 s; the bootstrap step ~6 min with the install
# (343 s of bootstrap under bf16 autocast); STEP=reflow with 18 iterations 289 s (its run 276 s, ~120 s of it cold
# compiles then); STEP=trl with a 270 s clock 394 s (TRL's start-up, the clock, two greedy scorings of 200 problems).
#   bash bench/gpu_machine/scratchpad_pair.sh [iterations] [overrides...]       # all steps in one call
#   STEP=bootstrap, then STEP=reflow bash bench/gpu_machine/scratchpad_pair.sh 50, then STEP=trl (three calls on one
#     warm machine, each under the 10-minute limit: the trl step reads what the reflow one left in
#     /tmp/gpurun/scratchpad_pair.env; it takes TRL's start-up + the seconds + two greedy scorings of 200 held-out
#     problems of up to ~900 tokens, so keep reflow's trained seconds well under 10 minutes)
#   A clock instead of a count: STEP=reflow ... 400 max_train_minutes=7 (the iteration that crosses 7 minutes is the
#     last; the pair reads how many ran from the run's latest checkpoint; keep it so that TRL's step, ~40 s more than
#     the clock plus its start-up, stays inside one 10-minute call)
#   EVALS=1 keeps reflow's evals before and during training (the default here is EVALS=0: TRL evaluates nothing
#   inside its clock, the gain is read against bootstrap.json, and the eval after the last iteration stays);
#   CLOCK=command and UNTIL=command as in compare.sh
# Carrying in three calls (session 44, 64 MiB a call): .gpuwheels/mini (partial.sh's header; a bench of its own may
# run in that call), then .gpuwheels/1 (ray's first part), then the rest with trl and reflow's wheel in the STEP=bootstrap
# call:  mkdir .gpuwheels/rest && for f in .gpuwheels/[23]/*; do case ${f##*/} in ray-*|boto*|s3transfer-*|
#   aiobotocore-*|py_spy-*|virtualenv-*) cp "$f" .gpuwheels/rest/;; esac; done   -> carry .gpuwheels/rest,
#   .gpuwheels/trl and .gpuwheels/reflow (~43 MiB)
set -euo pipefail
step=${STEP:-all}
cd "$(dirname "$0")/../.."
iters=${1:-50}; shift || true
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
repo=$PWD
policy=.reflow/models/scratchpad-gpu-s0 data=.reflow/data/scratchpad-gpu-s0  # in /tmp/gpurun, where run.sh runs
env_file=/tmp/gpurun/scratchpad_pair.env
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log"
[ -e /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpuwheels/trl/*.whl
# reflow itself before the bootstrap (run.sh would install it only after); run.sh is then told not to again
[ -e /tmp/site/reflow/flows/cli.py ] && [ -z "${REINSTALL_REFLOW:-}" ] \
  || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpuwheels/reflow/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$step" != trl ]; then
# The policy and its files first, outside both clocks (the demo would build them inside its timed run).
[ -e "/tmp/gpurun/$policy/config.json" ] || (mkdir -p /tmp/gpurun && cd /tmp/gpurun &&
  python3 -m reflow.flows.cli bootstrap --task scratchpad --size gpu \
    > "$out/scratchpad-bootstrap.json" 2> "$out/scratchpad-bootstrap.log")
python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('bootstrap: heldout', r['eval_accuracy_after'], \
'warmup_steps', r['warmup']['steps'], 'seconds', round(r['seconds']), 'checks (step, accuracy, loss)', \
[[c[0], round(c[1], 3), round(c[2], 4)] for c in r['warmup'].get('check_history', [])])" "/tmp/gpurun/$policy/bootstrap.json"
[ "$step" = bootstrap ] && exit 0
exp=gpu-sp-$(date +%H%M%S)
evals=(); [ "${EVALS:-0}" = 0 ] && evals=(eval.before_train=false eval.interval=null)
OUT=$out REINSTALL_REFLOW='' bash bench/gpu_machine/run.sh one --task scratchpad "experiment=$exp" \
  "num_iterations=$iters" "${evals[@]}" "$@" >/dev/null
cp "$out/demo-one.log" "$out/demo-$exp.log"
grep -E '^(\[ *[0-9.]+\] )?demo:' "$out/demo-$exp.log"
seconds=$(grep -o ' seconds=[0-9]*' "$out/demo-$exp.log" | tail -1 | cut -d= -f2)
command_s=$seconds
# trained_s: reflow's command start to its training loop's end (the final policy), as compare.sh gives TRL
trained=$(grep -o 'trained_s=[0-9]*' "$out/demo-$exp.log" | tail -1 | cut -d= -f2)
[ -n "$trained" ] && [ "${UNTIL:-trained}" = trained ] && seconds=$trained
sps=$(grep -o 'samples_per_s=[0-9.]*' "$out/demo-$exp.log" | tail -1 | cut -d= -f2)
# reflow's mean response length: response tokens over samples, all its iterations' rollouts
tokens=$(python3 -c "import glob, json, sys; m = [json.load(open(f)) for f in glob.glob(sys.argv[1])]; \
print(round(sum(x.get('response_tokens', 0) for x in m) / max(sum(x.get('samples', 0) for x in m), 1), 1))" \
  "/tmp/gpurun/.reflow/runs/$exp/iterations/*/metrics.json")
# the iterations the run made (fewer than asked where max_train_minutes ended it): its last committed checkpoint
last=$(cat "/tmp/gpurun/.reflow/runs/$exp/checkpoints/latest"); iters=$((10#${last#iter_}))
# the sampling temperature and rate reflow ran with (its run's config.yaml, overrides applied), which TRL then gets too
read -r temp lr < <(python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); \
print(c['rollout']['temperature'], c['trainer']['lr'])" "/tmp/gpurun/.reflow/runs/$exp/config.yaml")
printf 'exp=%s\niters=%s\nseconds=%s\ncommand_s=%s\nsps=%s\ntokens=%s\ntemp=%s\nlr=%s\n' "$exp" "$iters" "$seconds" \
  "$command_s" "$sps" "$tokens" "$temp" "$lr" > "$env_file"
fi
[ "$step" = reflow ] && exit 0
. "$env_file"
cd /tmp/gpurun
ckpt=$(ls -d ".reflow/runs/$exp/checkpoints/iter_$(printf %06d "$iters")")  # the run's last (see above)
rm -f "$out/trl-scratchpad.json"
python3 "$repo/bench/trl_baseline.py" --task scratchpad --policy "$policy" --data "$data" --reflow-model "$ckpt/model" \
  --seconds "$seconds" --clock "${CLOCK:-training}" --temperature "${temp:-1.0}" ${lr:+--lr "$lr"} \
  --out "$out/trl-scratchpad.json" 2>&1 \
  | tee "$out/trl-scratchpad.log" | grep -E '^trl:|Error|error' | tail -5 || true
[ -s "$out/trl-scratchpad.json" ] || { echo "scratchpad_pair.sh: TRL wrote no figures (see trl-scratchpad.log)" >&2; exit 1; }
python3 - "$out/trl-scratchpad.json" "$policy/bootstrap.json" "$out/gpu-long-task.json" \
  "$exp" "$iters" "$seconds" "$command_s" "$sps" "$tokens" "${CLOCK:-training}" <<'EOF'
import json, sys

trl_path, boot_path, out_path, exp, iters, seconds, command_s, sps, tokens, clock = sys.argv[1:]
t, boot = json.load(open(trl_path)), json.load(open(boot_path))
initial = boot["eval_accuracy_after"]  # the initial policy, scored by scratchpad_demo.accuracy at its bootstrap
figures = {
    "gain": round(t["reflow_accuracy"] - initial, 4), "seconds": int(seconds),
    "reflow_accuracy": t["reflow_accuracy"], "trl_accuracy": t["trl_accuracy"],
    "reflow_samples_per_s": float(sps), "trl_samples_per_s": round(t["trl_samples_per_s"], 1),
    "mean_response_tokens": float(tokens),
    "initial_accuracy": initial, "trl_gain": round(t["trl_accuracy"] - initial, 4),
    "trl_mean_response_tokens": round(t["mean_response_tokens"], 1), "iterations": int(iters),
    "trl_steps": t["trl_steps"], "reflow_command_seconds": int(command_s), "trl_clock": clock,
    "trl_startup_s": round(t["trl_startup_s"], 1), "num_eval": t["num_eval"], "experiment": exp,
}
open(out_path, "w").write(json.dumps(figures, indent=1) + "\n")
print("gpu-long-task: " + json.dumps(figures))
EOF
