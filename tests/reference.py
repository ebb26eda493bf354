"""Plain reference computations the tests compare the engines against."""
import torch


def greedy_reference(model, prompt, max_new, eos):
    """Greedy decoding by full-sequence forward passes: no cache, no padding, no batching."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            if t in eos:
                break
            ids.append(t)
    return out


# ---------------------------------------------------------------- the per-row log-prob / entropy math
# The implementation rl/losses.py used before its fused pass (`logprobs_and_entropy`): one fp32
# log-softmax per sequence, plain autograd. tests/test_fused_logprobs.py holds the fused one to it.
def token_logprobs_per_row(logits, labels, temperature: float = 1.0):
    import torch

    t = 1.0 if temperature <= 1e-6 else float(temperature)
    rows = []
    for b in range(logits.shape[0]):
        row = logits[b].float()  # [T, V]
        if t != 1.0:
            row = row / t
        lp = torch.log_softmax(row, dim=-1)  # [T, V]
        rows.append(lp.gather(-1, labels[b].long().unsqueeze(-1)).squeeze(-1))  # [T]
    return torch.stack(rows, dim=0)  # [B, T]


def entropy_per_row(logits):
    import torch

    rows = []
    for b in range(logits.shape[0]):
        row = logits[b].float()  # [T, V]
        p = torch.softmax(row, dim=-1)  # [T, V]
        rows.append(torch.logsumexp(row, dim=-1) - (p * row).sum(-1))  # [T]
    return torch.stack(rows, dim=0)  # [B, T]
