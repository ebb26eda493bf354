#!/usr/bin/env bash
# On the GPU machine: the GPU demo through the real `train` flow (Prefect flow run per iteration, Ray
# actors, DeepSpeed, the embedded engine with CUDA graphs), after the carried wheels are in place.
#
#   bash bench/gpu_machine/run.sh one    [overrides...]   # one GPU: engine and trainer colocated
#   bash bench/gpu_machine/run.sh split  [overrides...]   # two GPUs: trainer on one, engine on the other, NCCL pushes
#   bash bench/gpu_machine/run.sh ranks2 [overrides...]   # two GPUs: two trainer ranks, the engine colocated with rank 0
#
# Installs the wheels first if /tmp/site lacks them (bench/gpu_machine/install.sh; carry .gpuwheels/1,
# /2, ... over consecutive calls, then this). Writes the log and the run's records under $OUT (or ./gpu-out).
set -euo pipefail
cd "$(dirname "$0")/../.."
layout=${1:-one}; shift || true
out=${OUT:-gpu-out}; mkdir -p "$out"
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site >"$out/install.log"
[ -e /tmp/site/reflow/flows/cli.py ] && [ -z "${REINSTALL_REFLOW:-}" ] \
  || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpuwheels/reflow/*.whl
export PYTHONPATH=/tmp/site${RUN_PYTHONPATH:+:$RUN_PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_HOME=/tmp/prefect-home RAY_USAGE_STATS_ENABLED=0
# Prefect's database, created once per Prefect home before any timed run: on a fresh home its migrations are most of
# the temporary server's start (this VM: 13.4 s on a fresh home against 3.9 s on one that exists; RESULTS 25), which
# a user pays at the first run only (a harness step, like the bytecode install.sh compiles)
[ -e "$PREFECT_HOME/prefect.db" ] || python3 -c "import asyncio; from prefect.server.database import \
provide_database_interface as db; asyncio.run(db().create_db())" > "$out/prefect-db.log" 2>&1
# NVLink multicast off (the device notes: it is not available to lent machines)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case $layout in
  one) extra=() ;;
  split) extra=(cluster.colocate=false weight_sync.mode=distributed weight_sync.backend=nccl) ;;
  ranks2) extra=(trainer.num_ranks=2) ;;
  *) echo "run.sh: layout is one of one, split, ranks2 (got $layout)" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpus.txt"
out=$(realpath "$out")
stamp=$PWD/bench/gpu_machine/stamp.py
# Run outside the checkout: its reflow/ folder would shadow the installed package (the layers live elsewhere).
mkdir -p /tmp/gpurun && cd /tmp/gpurun
# Every line stamped with the seconds since the command started (where start-up time goes: RESULTS.md 16, 18).
python3 -m reflow.flows.cli demo --gpu "${extra[@]}" "$@" 2>&1 | python3 -u "$stamp" | tee "$out/demo-$layout.log"
# The run's per-iteration metrics and evals, for RESULTS.md (small: JSON only).
run=$(ls -td .reflow/runs/*/ | head -1); run=${run%/}  # the newest run, whatever experiment= named it
# Stage records hold every sample's tokens: with long responses (the scratchpad task) they took the archive past
# what a call brings back (16 MiB a file), so they stay; every iteration's metrics also go into one small file.
tar -czf "$out/records-$layout.tgz" --exclude='checkpoints' --exclude='*.parquet' --exclude='stages' \
  -C "$(dirname "$run")" "$(basename "$run")"
python3 - "$run" "$out/metrics-$layout.jsonl" <<'PY'
import json, sys
from pathlib import Path
with open(sys.argv[2], "w") as f:
    for m in sorted(Path(sys.argv[1], "iterations").glob("*/metrics.json")):
        f.write(json.dumps(json.loads(m.read_text())) + "\n")
PY
