#!/usr/bin/env bash
# On the GPU machine, after scratchpad_pair.sh's bootstrap step: reflow alone on the scratchpad task at each learning
# rate given, one after the other, evals every EVERY iterations (issue 56: which rate learns before a pair spends a
# call on TRL). Each run's demo log, per-iteration metrics and evals go into one small archive under $OUT
# (lr-<rate>.tgz: a call brings back few files), and one line per rate is printed: the held-out accuracy at each
# eval, the last iterations' sampled reward, response length and train/inference log-prob mismatch. Then the final
# policy's greedy held-out accuracy per operand size (bench/scratchpad_breakdown.py; BREAK_K=8 adds pass@8 at
# temperature 1, ~1 minute on an H100), in breakdown-<tag>.json.
#   bash bench/gpu_machine/scratchpad_lr.sh ITERATIONS LR [LR...]     (EVERY=5 by default; extra overrides in EXTRA;
#   TAG=name prefixes each rate's files, for variants of EXTRA at one rate; BREAK_K=-1 skips the breakdown)
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
iters=$1; shift
out=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$out"
for lr in "$@"; do
  # a run that ended badly must not leave its Ray processes holding the GPU for the next rate
  pkill -9 -f 'raylet|gcs_server|ray::' 2>/dev/null; sleep 1
  tag=${TAG:+$TAG-}$lr
  work=/tmp/lr-runs/$tag; rm -rf "$work"; mkdir -p "$work"
  rm -f /tmp/gpurun/scratchpad_pair.env  # written by a run that finished: the breakdown below must not read an older
  # shellcheck disable=SC2086
  STEP=reflow EVALS=1 OUT=$work bash bench/gpu_machine/scratchpad_pair.sh "$iters" "trainer.lr=$lr" \
    "eval.interval=${EVERY:-5}" ${EXTRA:-} > "$work/pair.log" 2>&1
  echo "lr=$lr tag=$tag exit=$?"
  python3 - "$work" "$lr" <<'PY'
import glob, json, re, sys
work, lr = sys.argv[1:]
rows = [json.loads(x) for x in open(f"{work}/metrics-one.jsonl")] if glob.glob(f"{work}/metrics-one.jsonl") else []
log = open(glob.glob(f"{work}/demo-one.log")[0]).read() if glob.glob(f"{work}/demo-one.log") else ""
# the demo's log is quiet: each eval shows in the progress bar's postfix ("eval heldout 0.405 @ 18")
evals = sorted({(int(v), float(a)) for a, v in re.findall(r"eval heldout ([0-9.]+) @ (\d+)", log)})
keys = ("reward_mean", "response_len_mean", "truncated_frac", "logprob_mismatch", "entropy", "time_iteration")
per = [{"it": r.get("iteration"), **{k: round(r[k], 4) for k in keys if isinstance(r.get(k), (int, float))}}
       for r in rows]
print(json.dumps({"lr": lr, "evals (version, greedy held-out accuracy)": evals, "iterations": len(rows),
                  "per_iteration": [list(p.values()) for p in per], "columns": ["it", *keys]}))
PY
  grep -E 'demo:' "$work/demo-one.log" 2>/dev/null | tail -3
  if [ "${BREAK_K:-0}" -ge 0 ] && [ -e /tmp/gpurun/scratchpad_pair.env ]; then
    (. /tmp/gpurun/scratchpad_pair.env && cd /tmp/gpurun &&
     PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 python3 "$repo/bench/scratchpad_breakdown.py" --k "${BREAK_K:-0}" \
       --policy ".reflow/runs/$exp/checkpoints/iter_$(printf %06d "$iters")/model" \
       --heldout .reflow/data/scratchpad-gpu-s0/heldout.jsonl --out "$out/breakdown-$tag.json" 2>&1 | grep '^breakdown:')
  fi
  tar -czf "$out/lr-$tag.tgz" -C "$work" --exclude='*.tgz' . 2>/dev/null
  cp "$work/records-one.tgz" "$out/records-lr-$tag.tgz" 2>/dev/null
done
