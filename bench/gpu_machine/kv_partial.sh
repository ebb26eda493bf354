#!/usr/bin/env bash
# On the GPU machine (after .gpuwheels/mini, partial.sh's header): the scratchpad config's rollout at its shape, with the
# KV cache in the model's dtype (fp32) and in bf16 (rollout.kv_cache_dtype), each with rollout.partial off and carry
# (partial.sh -> bench/partial_rollout.py; each KV dtype in its own process: CUDA graphs and compiles stay per
# process). The shape is configs/gpu-scratchpad.yaml's: the ~113M demo shape in fp32 with TF32 products, 128 prompts x
# 8 samples an iteration, 512 rows at once, max_new_tokens 1000, kv_mem_fraction 0.3, kv_reserve 0.5; random weights
# ending responses at a steady rate (median MEDIAN tokens, 300 by default: the scratchpad task's worked responses have
# a median of ~334-373 but a lighter tail than this geometric one, whose ~10 % past 1,000 are cut there).
# Each KV dtype (KV_DTYPES, default "auto bf16") at each batch width (BATCHES, default 512: max_batch_size, the rows
# decoding at once; 1024 takes the iteration's 1,024 samples in one wave, which a bf16 pool of 0.3 holds at kv_reserve
# 0.5) runs in its own process. Prints each run's table (with the decode loop's ms a step and `dev wait`, the share
# of it the host sat waiting for the device: near 0, host-bound) and `partial_rollout:` line; writes
# kv-<dtype>[-b<batch>].json and partial-kv-<dtype>[-b<batch>].log under $OUT (no suffix at 512).
#   OUT=$OUT bash bench/gpu_machine/kv_partial.sh [extra partial_rollout.py args]
#   KV_DTYPES=bf16 BATCHES="512 1024" MODES=off,carry OUT=$OUT bash bench/gpu_machine/kv_partial.sh
#   ... kv_partial.sh --anatomy 300: then one step of the full batch at 300 tokens a row, timed on the device alone
#   (its CUDA graph replayed) and profiled by kernel, beside the loop's ms a step
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-gpu-out}")
for kv in ${KV_DTYPES:-auto bf16}; do
  for b in ${BATCHES:-512}; do
    tag=kv-$kv; [ "$b" = 512 ] || tag=$tag-b$b
    CHECK_KERNELS=0 TAG=$tag OUT=$out bash bench/gpu_machine/partial.sh --prompts 128 --n 8 --max-new 1000 \
      --median "${MEDIAN:-300}" --iterations "${ITERATIONS:-3}" --warmup-iterations 1 --dtype fp32 --tf32 \
      --kv-mem-fraction 0.3 --kv-reserve 0.5 --max-batch-size "$b" --modes "${MODES:-off,carry}" --kv-dtype "$kv" \
      --json "$out/$tag.json" "$@" > /dev/null 2>&1
    echo "kv=$kv batch=$b exit=$?"; grep -E '^(mode|off|carry|drop)|partial_rollout:|Error' "$out/partial-$tag.log" | tail -8
    grep -A 16 '^anatomy:' "$out/partial-$tag.log" || true  # with --anatomy CTX: the device's share of a step
  done
done
