"""Evaluation metrics: pass@k (unbiased estimator), per-eval-set summaries. Pure Python.

pass@k follows Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1:
with n samples of a problem of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over problems. The binomials overflow for large n, so (as in the paper's numpy
snippet) the ratio is computed as the product  prod_{i = n-c+1}^{n} (1 - k / i),  and it is 1
outright when fewer than k samples are wrong (every k-subset then holds a correct one).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k} (draw more samples per prompt)")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(correct_per_group: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; each prompt's n is the number of its samples."""
    if not correct_per_group:
        raise ValueError("mean_pass_at_k: no prompts")
    return sum(pass_at_k(len(g), sum(map(bool, g)), k) for g in correct_per_group) / len(correct_per_group)


def _groups(group_index: Sequence[int], values: Sequence) -> list[list]:
    out: dict[int, list] = {}
    for g, v in zip(group_index, values):
        out.setdefault(g, []).append(v)
    return [out[g] for g in sorted(out)]


def eval_summary(group_index: Sequence[int], rewards: Sequence[float], correct: Sequence[bool],
                 response_lens: Sequence[int], finish_reasons: Sequence[str], ks: Sequence[int]) -> dict[str, float]:
    """Summary of one eval set at one policy version (one row per sample, prompt-major).

    Keys: reward_mean, pass@1 (mean fraction correct per prompt, the unbiased pass@1), pass@k for
    each k in `ks`, response_len_{mean,min,max}, finish_<reason> counts, prompts, samples.
    Every prompt must have at least max(ks) samples.
    """
    if not (len(group_index) == len(rewards) == len(correct) == len(response_lens) == len(finish_reasons)):
        raise ValueError("eval_summary: per-sample sequences differ in length")
    if not rewards:
        raise ValueError("eval_summary: no samples")
    per_prompt = _groups(group_index, correct)
    out = {"reward_mean": sum(rewards) / len(rewards),
           "pass@1": mean_pass_at_k(per_prompt, 1),
           **{f"pass@{k}": mean_pass_at_k(per_prompt, k) for k in sorted(set(ks))},
           "response_len_mean": sum(response_lens) / len(response_lens),
           "response_len_min": float(min(response_lens)), "response_len_max": float(max(response_lens)),
           "prompts": float(len(per_prompt)), "samples": float(len(rewards))}
    out.update({f"finish_{reason}": float(count) for reason, count in sorted(Counter(finish_reasons).items())})
    return out
