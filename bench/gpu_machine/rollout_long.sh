#!/usr/bin/env bash
# On the GPU machine: issue 55's long-generation bench (bench/gpu_rollout_long.py): the embedded engine at
# batch 256 with 1k-8k-token responses against the HBM roofline and HF generate, and the engine/trainer
# log-prob mismatch by position under bf16, bf16-mixed and fp32+tf32. Needs no wheels: torch and transformers
# are on the machine, and the engine imports nothing else.
#   OUT=/tmp/o bash bench/gpu_machine/rollout_long.sh [--skip mismatch] [--hf 0] ...
# The fused decode step (Generator's decode_fusion) against the eager one, each in a process of its own:
#   OUT=$OUT/eager bash bench/gpu_machine/rollout_long.sh --kernel triton --hf 0 --skip mismatch
#   OUT=$OUT/fused bash bench/gpu_machine/rollout_long.sh --kernel triton --hf 0 --skip mismatch --fuse inductor
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpus.txt"
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 bench/gpu_rollout_long.py --out "$out" "$@" 2>&1 | tee "$out/rollout-long.log"
