#!/usr/bin/env bash
# On the GPU machine, after the sglang folders have all arrived (sglang_carry.md): the next step of issue 57's GPU
# work, remembered in /tmp/sglang-state, so the SAME command issued call after call on one warm machine goes on from
# where the last call stopped (a call is at most 600 s; the machine keeps /tmp only while warm):
#   1. start:  bench/gpu_machine/sglang_start.sh (install on the first try), with launch flags tried in order until a
#              server generates: none; --attention-backend triton --sampling-backend pytorch; the same plus
#              --disable-cuda-graph (one try a call). The flags that worked are kept for the steps below.
#   2. bench:  bench/gpu_sglang.py: SGLang and the embedded engine, same model and requests (gpu-sglang-engines.json).
#   3. demo:   the GPU demo with rollout.backend=sglang through the real flow (bench/gpu_machine/run.sh one), bf16,
#              colocated (SGLang's memory saver), every push verified; its log and records.
# SGLang's server runs under /tmp/sglang-python (rollout.sglang_python): its site (/tmp/sglang-site, transformers
# 5.12.1 as 0.5.17 pins) first; reflow's processes keep the image's transformers and see only the bare `sglang`
# package (/tmp/sglang-bare), for its weight-bucket classes.
#   OUT=... bash bench/gpu_machine/sglang_next.sh [demo overrides...]
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD; OUT=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$OUT"
STATE=/tmp/sglang-state; mkdir -p "$STATE"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/next.log"; }
FLAGS=("" "--attention-backend triton --sampling-backend pytorch"
       "--attention-backend triton --sampling-backend pytorch --disable-cuda-graph")
# as rollout.sglang_server_args (grammar_backend none as sglang_start.sh launches: xgrammar is not carried; without
# it SGLang's scheduler imports its xgrammar backend and dies at start: seen on the H100, 2026-12-06)
JSONS=('{"grammar_backend": "none"}' '{"grammar_backend": "none", "attention_backend": "triton", "sampling_backend": "pytorch"}'
       '{"grammar_backend": "none", "attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": true}')

if [ ! -e "$STATE/started" ]; then
  k=$(cat "$STATE/attempt" 2>/dev/null || echo 0)
  [ "$k" -ge ${#FLAGS[@]} ] && { say "every start tried (see earlier calls' steps.log): nothing more to try"; exit 1; }
  echo $((k + 1)) > "$STATE/attempt"
  skip=0; [ -e /tmp/sglang-site/sglang ] && skip=1
  say "start attempt $k, flags: '${FLAGS[$k]}' (install skipped: $skip)"
  OUT=$OUT/start-$k SGLANG_SKIP_INSTALL=$skip SGLANG_EXTRA_FLAGS="${FLAGS[$k]}" SGLANG_TIMEOUT=240 \
    bash bench/gpu_machine/sglang_start.sh
  summary=$(head -1 "$OUT/start-$k/summary.txt" 2>/dev/null)
  say "start attempt $k: $summary"
  if [[ $summary == OK* ]]; then
    echo "${JSONS[$k]}" > "$STATE/server_args"; echo "${FLAGS[$k]}" > "$STATE/flags"
    [[ $summary == *"memory saver: --enable-memory-saver"* ]] && touch "$STATE/memsaver"
    touch "$STATE/started"
  fi
  exit 0
fi

# The server's interpreter and the bare package for reflow's side
cat > /tmp/sglang-python <<EOF
#!/bin/sh
PYTHONPATH=/tmp/sglang-site:/tmp/site-sg:$REPO/bench/gpu_machine/sglang_stubs exec python3 "\$@"
EOF
chmod 755 /tmp/sglang-python
mkdir -p /tmp/sglang-bare && ln -sfn /tmp/sglang-site/sglang /tmp/sglang-bare/sglang
ARGS=$(cat "$STATE/server_args")
say "server args: $ARGS; memory saver: $([ -e "$STATE/memsaver" ] && echo on || echo off)"

if [ ! -e "$STATE/bench" ]; then
  touch "$STATE/bench"  # one try: a failure is recorded, the next call goes on to the demo
  PYTHONPATH=/tmp/site:$REPO/src:$REPO/bench:/tmp/sglang-bare HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    timeout 560 python3 bench/gpu_sglang.py --out "$OUT" --sglang-python /tmp/sglang-python --server-args "$ARGS" \
    $([ -e "$STATE/memsaver" ] || echo --no-memory-saver) 2>&1 | tail -40 | tee -a "$OUT/next.log"
  exit 0
fi

if [ ! -e "$STATE/demo" ]; then
  touch "$STATE/demo"
  [ -e "$STATE/memsaver" ] || say "no memory saver: the colocated demo cannot hand the GPU over; trying anyway"
  over=(rollout.backend=sglang rollout.sglang_python=/tmp/sglang-python trainer.precision=bf16 num_iterations=100
        weight_sync.verify_every=1 rollout.mem_fraction_static=0.5)
  for kv in $(python3 -c "import json,sys; [print(f'rollout.sglang_server_args.{k}={str(v).lower() if isinstance(v, bool) else v}') for k, v in json.load(sys.stdin).items()]" <<< "$ARGS"); do
    over+=("$kv")
  done
  say "demo: ${over[*]} $*"
  OUT=$OUT RUN_PYTHONPATH=/tmp/sglang-bare timeout 570 bash bench/gpu_machine/run.sh one "${over[@]}" "$@" \
    > "$OUT/demo-run.log" 2>&1
  say "demo exit $?: $(tail -5 "$OUT/demo-run.log" | tr '\n' ' ')"
  exit 0
fi
say "all steps done (rm -rf $STATE to start again)"
