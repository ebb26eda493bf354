#!/usr/bin/env bash
# On the GPU machine: the GPU demo's learning per update under several precision settings, from one initial
# policy and the same seeds (on-policy, seeded sampling: the runs differ only in their arithmetic), one after
# another in one call (bench/RESULTS.md 28: fp32 0.924 against bf16 0.854 after 300 iterations on one lease).
#   OUT=/tmp/o bash bench/gpu_machine/precision.sh [iterations] [overrides for every run...]
#   VARIANTS='trainer.precision=bf16|trainer.fp32_lm_head=true' ...   # '|' between runs, ' ' inside one
# Default variants: bf16; bf16-mixed + fp32 LM head; fp32 + tf32 (the GPU demo's since RESULTS 29; plain fp32 at
# 0.48 s a train stage, 2.5x bf16's, fits a second call: VARIANTS='trainer.precision=fp32 trainer.tf32=false').
# Each run gets LIMIT seconds (default 200).
# Prints one `precision:` line per run and writes $OUT/precision.json; TRL can follow in the next call
# (STEP=trl CLOCK=command bash bench/gpu_machine/compare.sh), on the last run's clock.
set -uo pipefail
cd "$(dirname "$0")/../.."
iters=${1:-200}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
IFS='|' read -r -a variants <<< "${VARIANTS:-trainer.precision=bf16 trainer.tf32=false|trainer.precision=bf16-mixed trainer.fp32_lm_head=true trainer.tf32=false|trainer.precision=fp32 trainer.tf32=true}"
results=()
for v in "${variants[@]}"; do
  name=$(echo "$v" | tr ' =/' '_-_'); mkdir -p "$out/$name"
  read -r -a over <<< "$v"
  STEP=reflow RESUME=0 EVALS=0 OUT="$out/$name" timeout "${LIMIT:-200}" bash bench/gpu_machine/compare.sh "$iters" \
    checkpoint.save_interval=1000 "$@" "${over[@]}" > "$out/$name/compare.out" 2>&1
  rc=$?
  line=$(grep -hE 'demo: accuracy' "$out/$name/compare.out" | tail -1)
  rate=$(grep -ho 'samples_per_s=[0-9.]*' "$out/$name/compare.out" | tail -1)
  echo "precision: [$v] rc=$rc ${line#*demo: } $rate"
  results+=("{\"variant\": \"$v\", \"rc\": $rc, \"line\": \"${line#*demo: } $rate\"}")
done
(IFS=,; echo "{\"iterations\": $iters, \"runs\": [${results[*]}]}") > "$out/precision.json"
