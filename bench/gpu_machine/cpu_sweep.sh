#!/usr/bin/env bash
# On the device machine, CPU only: its 16 cores stand in for eight 2-core machines (the dev/CI machine).
# bench/learning_speed.py runs every setting of the given seeds at once, each run pinned to 2 cores of
# its own (cores 0-13: seven runs); with OVERHEAD_SIZES set, bench/iteration_overhead.py runs meanwhile
# on cores 14-15. The GPU is hidden (CUDA_VISIBLE_DEVICES=, cluster.gpus=off); each run's Ray gets the
# 4 logical CPUs a 2-core machine gets (infra/cluster/ray_connect.py: max(4, cores)).
#
#   OVERHEAD_SIZES=small,large,large10 bash bench/gpu_machine/cpu_sweep.sh 0   # seed 0 + the overhead bench
#   bash bench/gpu_machine/cpu_sweep.sh 1                                      # seed 1
#
# Carry .gpuwheels/1, /2 in earlier calls, then .gpuwheels/3, .gpuwheels/reflow and .reflow/models (the
# warmed-up demo policies of the seeds, built here by `reflow demo --seed N` / learning_speed.py).
# The runs are stopped LIMIT seconds (default 560) after this script started, installs included, so that
# what finished comes back in $OUT (one archive) inside the device's 600 s per command.
set -uo pipefail
cd "$(dirname "$0")/../.."
seeds=${1:?seeds, e.g. 0 or 0,1}
out=${OUT:-cpu-out}; mkdir -p "$out"; out=$(realpath "$out")
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site >"$out/install.log" || exit 2
[ -e /tmp/site/reflow/flows/cli.py ] && [ -z "${REINSTALL_REFLOW:-}" ] \
  || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpuwheels/reflow/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export CUDA_VISIBLE_DEVICES= NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Outside the checkout: its reflow/ folder would shadow the installed package; bench/ finds configs/ and
# .reflow/models/ beside itself.
run=/tmp/cpurun; mkdir -p "$run/.reflow" && cp -r bench configs "$run/" && cp -r .reflow/models "$run/.reflow/"
cd "$run"
limit=$(( ${LIMIT:-560} - SECONDS ))
(while sleep 30; do echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; done) >"$out/load.log" &
loadmon=$!
ov=""
if [ -n "${OVERHEAD_SIZES:-}" ]; then
  timeout "$limit" taskset -c 14,15 python3 bench/iteration_overhead.py --sizes "$OVERHEAD_SIZES" \
    --override cluster.num_cpus=4 --override cluster.gpus=off >"$out/overhead.log" 2>&1 &
  ov=$!
fi
save="$run/ls-seed${seeds//,/_}"
timeout "$limit" taskset -c 0-13 python3 bench/learning_speed.py --seed-list "$seeds" --parallel 7 \
  --override cluster.num_cpus=4 --override cluster.gpus=off --save "$save" >"$out/learning.log" 2>&1
echo "learning_speed exit $?" >>"$out/learning.log"
[ -n "$ov" ] && { wait "$ov"; echo "iteration_overhead exit $?" >>"$out/overhead.log"; }
kill "$loadmon"
tar -czf "$out/ls-seed${seeds//,/_}.tgz" --exclude='prefect-*' -C "$run" "$(basename "$save")"
nproc >"$out/machine.txt"; uptime >>"$out/machine.txt"
