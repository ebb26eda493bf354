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
