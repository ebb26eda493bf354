"""Where a scratchpad policy is right and where sampling could still find the answer (issue 56: how much an RL run
can gain from a warm policy). Scores an HF policy folder on the held-out file:

- greedy accuracy per operand-digit class (the larger operand's digits; and by the digits of both together),
- k samples per problem at `--temperature`: the per-sample accuracy (RL's reward at that temperature), pass@k
  (a problem solved by at least one), and the share of problems whose k samples disagree (a GRPO group of k
  with a learning signal; all right or all wrong gives none).

Needs torch and transformers only (no Ray, no Prefect). On a GPU in batches of `--batch` rows:

    PYTHONPATH=src python3 bench/scratchpad_breakdown.py --policy /tmp/gpurun/.reflow/models/scratchpad-gpu-s0 \\
        --heldout /tmp/gpurun/.reflow/data/scratchpad-gpu-s0/heldout.jsonl --k 8 --out $OUT/breakdown.json

Prints one JSON line `breakdown: {...}` and writes it to --out when given.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from reflow.rl import scratchpad_task
from reflow.rl.data import encode_prompt
from reflow.rl.demo_policy import _greedy
from reflow.rl.scratchpad_demo import _solved


def _digits(row: dict) -> tuple[int, int]:
    a, b = scratchpad_task.operands(row["prompt"])
    return len(str(a)), len(str(b))


def _decode(model, tok, rows: list[dict], temperature: float, batch: int, seed: int) -> list[bool]:
    """Whether each row's one continuation (greedy at temperature 0, else sampled) earns the task's reward."""
    longest = max(len(scratchpad_task.row_trace(r)) for r in rows) + 1
    prompts, eos, right = encode_prompt(tok, [r["prompt"] for r in rows]), tok.eos_token_id, []
    g = torch.Generator(device=model.device).manual_seed(seed)
    for s in range(0, len(rows), batch):
        outs = _greedy(model, prompts[s:s + batch], longest, eos, tok.pad_token_id or 0, temperature=temperature,
                       generator=g)
        for row, ids in zip(rows[s:s + batch], outs):
            text = tok.decode(ids, skip_special_tokens=True)
            right.append(bool(ids) and ids[-1] == eos and _solved(row, text))
    return right


def breakdown(policy: str, heldout: str, k: int = 8, temperature: float = 1.0, batch: int = 512, seed: int = 0,
              limit: int | None = None, device: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(x) for x in Path(heldout).read_text().splitlines()][:limit]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.set_float32_matmul_precision("high")
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).to(device).eval()
    t0 = time.perf_counter()
    greedy = _decode(model, tok, rows, 0.0, batch, seed)
    greedy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sampled = _decode(model, tok, [r for r in rows for _ in range(k)], temperature, batch, seed) if k else []
    sampled_s = time.perf_counter() - t0
    by_max, by_sum, rows_by_max = defaultdict(list), defaultdict(list), defaultdict(list)
    for i, (row, ok) in enumerate(zip(rows, greedy)):
        da, db = _digits(row)
        by_max[max(da, db)].append(ok)
        by_sum[da + db].append(ok)
        rows_by_max[max(da, db)].append(i)

    def table(d: dict) -> dict:
        return {str(n): {"rows": len(v), "greedy": round(sum(v) / len(v), 3)} for n, v in sorted(d.items())}

    out: dict[str, Any] = {"policy": policy, "rows": len(rows), "greedy_accuracy": round(sum(greedy) / len(rows), 4),
           "by_larger_operand_digits": table(by_max), "by_total_digits": table(by_sum),
           "greedy_s": round(greedy_s, 1), "device": device}
    if k:
        groups = [sampled[i * k:(i + 1) * k] for i in range(len(rows))]
        out.update({"k": k, "temperature": temperature,
                    "sampled_accuracy": round(sum(sampled) / len(sampled), 4),
                    f"pass_at_{k}": round(sum(any(g) for g in groups) / len(rows), 4),
                    "mixed_groups": round(sum(0 < sum(g) < k for g in groups) / len(rows), 4),
                    "sampled_s": round(sampled_s, 1)})
        for n, idx in rows_by_max.items():
            out["by_larger_operand_digits"][str(n)].update(
                {"sampled": round(sum(sum(groups[i]) for i in idx) / (k * len(idx)), 3),
                 f"pass_at_{k}": round(sum(any(groups[i]) for i in idx) / len(idx), 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True, help="HF policy folder (a bootstrap's, or a checkpoint's model/)")
    ap.add_argument("--heldout", required=True, help="the held-out jsonl ({prompt, label} rows)")
    ap.add_argument("--k", type=int, default=8, help="samples per problem (0: greedy only)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the k samples")
    ap.add_argument("--batch", type=int, default=512, help="rows decoded at once")
    ap.add_argument("--limit", type=int, default=None, help="only the first N held-out rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    r = breakdown(a.policy, a.heldout, a.k, a.temperature, a.batch, a.seed, a.limit)
    print("breakdown: " + json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
