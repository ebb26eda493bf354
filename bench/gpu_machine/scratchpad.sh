#!/usr/bin/env bash
# On the GPU machine (after the carried wheels, as for run.sh): issue 56's long-response task, reflow's side only.
# The scratchpad policy is bootstrapped on the GPU first, outside the timed run (its report, with the held-out
# accuracy, the warm-up's steps and seconds: $OUT/scratchpad-bootstrap.json), then `reflow demo --gpu --task
# scratchpad` (configs/gpu-scratchpad.yaml) runs through run.sh, which writes its log and records under $OUT.
# NOT RUN YET: written before any GPU call. The issue's pair (this bootstrap and run, then TRL from the same policy
# for reflow's trained seconds, one evaluator for both) is bench/gpu_machine/scratchpad_pair.sh, not run either.
#   OUT=/tmp/o bash bench/gpu_machine/scratchpad.sh [overrides...]     # e.g. num_iterations=50 eval.interval=25
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log"
# In /tmp/gpurun, where run.sh runs the demo: `reflow demo --task scratchpad` finds the policy and data there.
[ -e /tmp/gpurun/.reflow/models/scratchpad-gpu-s0/config.json ] || (mkdir -p /tmp/gpurun && cd /tmp/gpurun &&
  PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false python3 -m reflow.flows.cli bootstrap \
    --task scratchpad --size gpu > "$out/scratchpad-bootstrap.json" 2> "$out/scratchpad-bootstrap.log")
OUT=$out bash bench/gpu_machine/run.sh one --task scratchpad "$@"
