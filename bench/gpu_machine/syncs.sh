#!/usr/bin/env bash
# On the GPU machine: the decode loop's host waits (issue 55), this tree against an older one, the same work each in a
# process of its own (bench/gpu_rollout_long.py --syncs: seeded longtail and stream rows at batch 256, Qwen2.5-1.5B
# shape, bf16). The older tree's src/ travels as an ignored folder:
#   mkdir -p .gpuwheels/baseline && git archive <commit> src | tar -x -C .gpuwheels/baseline   (here, then carry it)
#   OUT=$OUT bash bench/gpu_machine/syncs.sh [.gpuwheels/baseline/src] [bench args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
base=${1:-.gpuwheels/baseline/src}; shift || true
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpus.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for v in old new; do
  src=$PWD/src; [ "$v" = old ] && src=$(realpath "$base")
  PYTHONPATH=$src:$PWD/bench python3 bench/gpu_rollout_long.py --out "$out" --syncs "$v" "$@" 2>&1 \
    | tee "$out/syncs-$v.log" | grep -E '^  (syncs|longtail|stream)|Error|error'
done
python3 - "$out" <<'PY'
import json, sys
rows = {v: {r["workload"]: r for r in json.load(open(f"{sys.argv[1]}/syncs-{v}.json"))["syncs"]["rows"]} for v in ("old", "new")}
print("syncs:", json.dumps({w: {"old_s": round(rows["old"][w]["seconds"], 2), "new_s": round(rows["new"][w]["seconds"], 2),
      "speedup": round(rows["old"][w]["seconds"] / rows["new"][w]["seconds"], 3),
      "roofline_old": round(rows["old"][w]["roofline_fraction"], 3), "roofline_new": round(rows["new"][w]["roofline_fraction"], 3),
      "waits_old": rows["old"][w]["host_waits_short_run"], "waits_new": rows["new"][w]["host_waits_short_run"]}
      for w in rows["new"]}))
PY
