#!/usr/bin/env bash
# On a machine with two GPUs (nvidia-h200-x2), after the carried wheels (.gpuwheels/1, /2 over the calls before,
# then /3, reflow and trl with this one): everything that needs the second GPU, in one command.
#   1. the distributed push over NCCL against a plain NCCL broadcast of the same bytes (bench/gpu.py --nccl;
#      writes $OUT/gpu-nccl.json);
#   2. the GPU demo through the real train flow with the split placement (trainer on GPU 0, engine on GPU 1,
#      pushes over NCCL: run.sh split), evals before, at iteration 100 and after;
#   3. the same with two trainer ranks on the two GPUs and the engine colocated with rank 0 (run.sh ranks2).
#
#   OUT=<folder> bash bench/gpu_machine/two_gpus.sh [iterations] [overrides...]
#   PARTS="split ranks2" leaves the NCCL push out (default: "nccl split ranks2"); COMMIT names the measured commit.
# Each part has its own time limit (LIMIT seconds per run, default 280), so a hang costs one part, not the call.
# It leaves ~11 files in OUT (logs, records-<layout>.tgz, gpu-nccl.json); the lent machines return at most 8: point OUT
# at a scratch folder and tar it into the call's $OUT (`tar -czf $OUT/o.tgz -C /tmp/o .`, no checkpoints in it).
set -uo pipefail
cd "$(dirname "$0")/../.."
iters=${1:-200}; shift || true
out=$(realpath "${OUT:-gpu-out}"); mkdir -p "$out"
limit=${LIMIT:-280}
[ -e /tmp/site/ray ] || bash bench/gpu_machine/install.sh .gpuwheels /tmp/site > "$out/install.log" 2>&1 \
  || { tail -5 "$out/install.log"; exit 2; }
[ -e /tmp/site/reflow/flows/cli.py ] \
  || python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .gpuwheels/reflow/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device notes: keep off
python3 -c "import torch; n = torch.cuda.device_count(); print('gpus:', n); assert n >= 2, 'two GPUs needed'" || exit 2
nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true
repo=$PWD
for part in ${PARTS:-nccl split ranks2}; do
  t0=$(date +%s)
  case $part in
    nccl)
      # gpu.py imports its sibling modules: run it from a copy outside the checkout (its reflow/ would shadow
      # the installed package).
      rm -rf /tmp/b && cp -r bench /tmp/b
      (cd /tmp/b && OUT=$out timeout "$limit" python3 gpu.py --skip trainer,engine --nccl --repeat 3 \
        --commit "${COMMIT:-unknown}") > "$out/nccl.log" 2>&1
      echo "nccl: rc=$? $(grep -E 'nccl push' "$out/nccl.log" | tail -1)" ;;
    split|ranks2)
      # The policy first (the demo would build it inside its timed run), as compare.sh does.
      [ -e /tmp/gpurun/.reflow/models/gpu-demo-policy/config.json ] || (mkdir -p /tmp/gpurun && cd /tmp/gpurun &&
        python3 -m reflow.flows.cli bootstrap --size gpu --digits 3 --data-out '' \
          --out .reflow/models/gpu-demo-policy > "$out/bootstrap.json" 2>/dev/null)
      OUT=$out timeout "$limit" bash "$repo/bench/gpu_machine/run.sh" "$part" "experiment=gpu-$part-$(date +%H%M%S)" \
        "num_iterations=$iters" "$@" > /dev/null 2>&1
      echo "$part: rc=$? $(grep -E '^(\[ *[0-9.]+\] )?demo:' "$out/demo-$part.log" | tail -1)" ;;
    *) echo "two_gpus.sh: unknown part $part" >&2 ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s"
done
