#!/usr/bin/env bash
# On the GPU machine (after .gpuwheels/mini, partial.sh's header): the scratchpad config's rollout at its shape, with the
# KV cache in the model's dtype (fp32) and in bf16 (rollout.kv_cache_dtype), each with rollout.partial off and carry
# (partial.sh -> bench/partial_rollout.py; each KV dtype in its own process: CUDA graphs and compiles stay per
# process). The shape is configs/gpu-scratchpad.yaml's: the ~113M demo shape in fp32 with TF32 products, 128 prompts x
# 8 samples an iteration, 512 rows at once, max_new_tokens 1000, kv_mem_fraction 0.3, kv_reserve 0.5; random weights
# ending responses at a steady rate (median MEDIAN tokens, 300 by default: the scratchpad task's worked responses have
# a median of ~334-373 but a lighter tail than this geometric one, whose ~10 % past 1,000 are cut there).
# Prints each run's table and `partial_rollout:` line; writes kv-<dtype>.json and partial-kv-<dtype>.log under $OUT.
#   OUT=$OUT bash bench/gpu_machine/kv_partial.sh [extra partial_rollout.py args]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-gpu-out}")
for kv in ${KV_DTYPES:-auto bf16}; do
  CHECK_KERNELS=0 TAG=kv-$kv OUT=$out bash bench/gpu_machine/partial.sh --prompts 128 --n 8 --max-new 1000 \
    --median "${MEDIAN:-300}" --iterations "${ITERATIONS:-3}" --warmup-iterations 1 --dtype fp32 --tf32 \
    --kv-mem-fraction 0.3 --kv-reserve 0.5 --max-batch-size 512 --modes "${MODES:-off,carry}" --kv-dtype "$kv" \
    --json "$out/kv-$kv.json" "$@" > /dev/null 2>&1
  echo "kv=$kv exit=$?"; grep -E '^(mode|off|carry|drop)|partial_rollout:|Error' "$out/partial-kv-$kv.log" | tail -8
done
