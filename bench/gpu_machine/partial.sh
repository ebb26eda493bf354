#!/usr/bin/env bash
# On the GPU machine: issue 55 point 3's partial_speedup and idle fractions (bench/partial_rollout.py): rollout
# seconds per iteration with rollout.partial off, carry and drop at the same trained samples, on the embedded engine
# over HTTP with CUDA graphs, the GPU demo's shape (113M, random weights ending responses at a steady rate: median
# 512 tokens, p99 ~3.4k, capped at 4,096). The engine's HTTP side (fastapi, uvicorn, httpx) comes from the carried
# wheels (bench/gpu_machine/install.sh; carry .gpuwheels/1, /2, ... over consecutive calls first, or, in one call, a
# folder of every wheel but ray's, boto's and virtualenv's, which this bench does not need (accelerate imports boto3
# only where it is there): 51 MiB of 107 wheels,
#   mkdir .gpuwheels/mini && for f in .gpuwheels/[123]/*; do case ${f##*/} in ray-*|boto*|s3transfer-*|aiobotocore-*|
#   py_spy-*|virtualenv-*) ;; *) cp "$f" .gpuwheels/mini/;; esac; done   -> carry .gpuwheels/mini alone). The engine in
# bf16 with the per-row-length decode kernel; the policy's end rate calibrated on its own samples (long_tail.py).
# Six iterations a mode: the first (carry's pool still filling) is left out of the `steady` figures
# (partial_speedup_steady), reported beside the all-iteration ones (partial_speedup).
#   OUT=/tmp/o bash bench/gpu_machine/partial.sh [--prompts 64 --chunk 256 ...]   (later arguments win)
# CHECK_KERNELS=0 skips the kernel check; TAG=name writes partial-<name>.log (kv_partial.sh runs it so, per KV dtype).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
[ -e /tmp/site/fastapi ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpus.txt"
export PYTHONPATH=$PWD/src:$PWD/bench:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The decode-attention kernels against float32 SDPA first (bf16; float32 with IEEE and with TF32 products)
[ "${CHECK_KERNELS:-1}" = 0 ] || python3 bench/gpu_rollout_long.py --check-kernels --out "$out" 2>&1 | tee "$out/kernel-check.log"
python3 bench/partial_rollout.py --device cuda --size gpu --prompts 64 --n 4 --max-new 4096 --median 512 \
  --chunk 256 --over 0.5 --iterations 6 --dtype bf16 --kv-mem-fraction 0.6 --json "$out/gpu-partial.json" "$@" 2>&1 \
  | tee "$out/partial${TAG:+-$TAG}.log"
