"""The demo's tiny policy: a character-level tokenizer and a small Llama-style causal LM.

Built locally (no hub), saved with `save_pretrained` as a normal HF checkpoint folder, so the
trainer and engines load it exactly like a user's own checkpoint.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from reflow.rl.imports import mlflow_hidden

Accuracy = Callable[..., float]  # (model, tokenizer, rows) -> share of rows the model solves

# Characters of the synthetic arithmetic task; special tokens come first.
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=() ")


def build_tokenizer():
    """Character-level `PreTrainedTokenizerFast` (each character is one token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False)


def build_model(tokenizer, hidden: int = 128, layers: int = 4, heads: int = 4, mlp: int = 512,
                max_positions: int = 128, seed: int = 0):
    """A randomly initialised Llama-style causal LM sized for the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for a tiny model's CPU warm-up, then as before. Its ops are too small to split, and on
    a busy machine threads that wait for each other made a step take 2.5-4 s instead of ~0.3 s (2 cores, load
    average 6; the scratchpad warm-up: 100 steps in 3 s on one thread, 150 in 20 s on two, load average 4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def save_policy(model, tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with mlflow_hidden():  # save_pretrained imports DeepSpeed where it is installed, which imports MLflow
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------
# Supervised warm-up: makes the random policy partially competent so that RL has signal
# (GRPO needs some correct samples per group; from a random model every reward is 0).


def _label(row: dict) -> str:
    return str(row["label"])


def answer_batch(tokenizer, rows: list[dict], target: Callable[[dict], str] = _label,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded "prompt + answer + eos" with labels only on answer + eos (-100 elsewhere). The answer
    is `target(row)`: the label, or a task's whole worked response (reflow.rl.scratchpad_demo)."""
    from reflow.rl.data import encode_prompt

    prompts = encode_prompt(tokenizer, [r["prompt"] for r in rows])
    answers = tokenizer([target(r) for r in rows], add_special_tokens=False)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(seqs), T), dtype=torch.long)  # [B, T]
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)  # [B, T]
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, len(p) : len(s)] = torch.tensor(s[len(p):])
    return ids, attn, labels


def _sft_step(model, opt, tokenizer, rows: list[dict], batch_fn=None, autocast: bool = False,
              micro_batches: int = 1) -> float:
    """One AdamW step on `rows`; `autocast`: the forward under bf16 autocast (on a GPU: float32 weights and
    optimizer, bf16 products and activations). `micro_batches` > 1: the rows sorted by length and cut into that
    many forwards, each padded only to its own longest, their gradients summed with each forward's mean loss
    weighted by its share of the step's label tokens: the step's loss and gradient are the one-forward ones (to
    float rounding) on less padding (the scratchpad's GPU rows are 83-913 tokens: one forward padded every row to
    ~900). Returns the loss over the step's label tokens."""
    ids, attn, labels = (batch_fn or answer_batch)(tokenizer, rows)  # [B, T] each, right-padded
    chunks = [torch.arange(len(rows))] if micro_batches <= 1 else \
        [c for c in torch.argsort(attn.sum(1), stable=True).chunk(micro_batches) if len(c)]
    total = int((labels[:, 1:] != -100).sum())  # the model shifts labels by one: these are the tokens it scores
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for rows_c in chunks:
        width = int(attn[rows_c].sum(1).max())  # right-padded: the whole batch's width where there is one chunk
        ids_c, attn_c, labels_c = (t[rows_c, :width].to(model.device) for t in (ids, attn, labels))  # [b, width]
        scored = int((labels_c[:, 1:] != -100).sum())
        if scored == 0:
            continue
        with torch.autocast(model.device.type, torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=ids_c, attention_mask=attn_c, labels=labels_c).loss
        (loss * (scored / total)).backward()
        loss_sum += loss.item() * scored
    opt.step()
    return loss_sum / max(total, 1)


def _recent_loss(losses: list[float]) -> float:
    """The mean loss of the last 10 warm-up steps (at least one): the check's gate and the reported loss_last."""
    tail = losses[-10:]
    return sum(tail) / len(tail)


def warmup(model, tokenizer, train_rows: list[dict], steps: int = 350, batch: int = 64, lr: float = 1e-3,
           seed: int = 0, progress: bool = True, stop_accuracy: float | None = None,
           check_rows: list[dict] | None = None, check_every: int = 25, batch_fn=None,
           accuracy: Accuracy | None = None, autocast: bool = False, check_below_loss: float | None = None,
           micro_batches: int = 1) -> dict:
    """Supervised fine-tuning on the answers (cross-entropy on answer + eos tokens only).

    Constant-lr torch AdamW, `batch` rows drawn uniformly with replacement each step. With
    `stop_accuracy`, every `check_every` steps the greedy accuracy on `check_rows` (default: the
    first 200 train rows) is measured and training stops once it reaches the target, so `steps`
    is then a maximum. Why: accuracy rises steeply and the step where it does varies by ~±50
    between seeds, so a fixed step count lands anywhere from 0.15 to 0.55. Another task (the tools
    demo, reflow.rl.tool_demo) passes its own `batch_fn(tokenizer, rows) -> (ids, attention, labels)`, and
    its own `accuracy(model, tokenizer, rows)` for the check (default: greedy exact answers, `greedy_accuracy`).
    `autocast`: each step's forward under bf16 autocast (_sft_step); `micro_batches`: each step's rows in that many
    forwards by length (_sft_step: the same step on less padding). `check_below_loss`: a check is skipped while the
    mean loss of the last 10 steps is above it (a long-response task scores 0 until its loss is near 0, and each
    greedy check of 200 ~900-token traces cost ~16 s on an H100: four of the six in a bootstrap found 0 there).
    Returns {"steps" (taken), "loss_first", "loss_last" (mean of the last 10), "check_accuracy",
    "checks" (how many ran), "check_history" ([step, accuracy, the last 10 steps' mean loss] of each), "seconds"}.
    """


    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    check_rows = check_rows if check_rows is not None else train_rows[:200]
    if accuracy is None:
        max_new = 1 + max((len(tokenizer(str(r["label"]), add_special_tokens=False)["input_ids"])
                           for r in check_rows), default=0)  # longest answer + eos
        accuracy = functools.partial(greedy_accuracy, max_new_tokens=max_new)
    losses, acc, checks, history, t0 = [], None, 0, [], time.perf_counter()
    bar = tqdm(total=steps, desc="warm-up", disable=not progress)
    for step in range(1, steps + 1):
        model.train()
        pick = torch.randint(len(train_rows), (batch,), generator=gen).tolist()
        losses.append(_sft_step(model, opt, tokenizer, [train_rows[i] for i in pick], batch_fn, autocast,
                                micro_batches))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=acc, refresh=False)
        bar.update(1)
        if stop_accuracy is not None and step % check_every == 0 and (
                check_below_loss is None or _recent_loss(losses) <= check_below_loss):
            acc, checks = accuracy(model, tokenizer, check_rows), checks + 1
            history.append([step, acc, _recent_loss(losses)])  # where in the band a stop lands (bootstrap.json)
            if model.device.type == "cuda":  # the check's decode cache goes back: a GPU bootstrap that kept it ran out
                torch.cuda.empty_cache()  # of memory at the next long batch with ~21 GiB reserved but free (an H100)
            if acc >= stop_accuracy:  # an early stop is the plan, not a crash: the bar ends at 100 % and says so
                bar.set_description_str(f"warm-up: accuracy {acc:.2f} reached the target {stop_accuracy} at step {step}")
                bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{acc:.2f}", refresh=False)
                bar.total = step
                break
    bar.close()
    model.eval()
    return {"steps": len(losses), "loss_first": losses[0] if losses else None,
            "loss_last": _recent_loss(losses) if losses else None, "check_accuracy": acc, "checks": checks,
            "check_history": history,
            "seconds": time.perf_counter() - t0}


@torch.no_grad()
def _greedy(model, prompt_ids: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int = 0,
            temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Greedy continuations of `prompt_ids` in one batch, KV-cached, each stopping at eos. Prompts of one length
    run as they are (no mask); of several lengths, left-padded, the padding masked out and each row's positions
    counted from its first real token, so a row continues as it would alone. `temperature` > 0 samples from
    softmax(logits / temperature) instead (with `generator`), for pass@k reports (bench/scratchpad_breakdown.py)."""
    from transformers import DynamicCache

    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=model.device)  # [B, P]
    # transformers 5.x renamed `past_key_values` to `cache`; the cache object is updated in place
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = {key: DynamicCache(config=model.config), "use_cache": True}
    padded: dict[str, torch.Tensor] = {}
    if any(len(p) != width for p in prompt_ids):
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=model.device)
        padded = {"attention_mask": attn, "position_ids": (attn.cumsum(1) - 1).clamp(min=0)}  # [B, P] each
    out, new = model(input_ids=ids, **padded, **kv), []
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=model.device)  # [B]
    for _ in range(max_new_tokens):
        last = out.logits[:, -1].float()  # [B, V]
        nxt = (last.argmax(-1) if temperature <= 0 else  # [B]
               torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator)[:, 0])
        new.append(nxt)
        done |= nxt == eos_id
        if bool(done.all()):
            break
        if padded:  # the new token attends to everything so far, one position past the row's last
            attn = padded["attention_mask"]
            padded = {"attention_mask": torch.cat([attn, attn.new_ones(len(prompt_ids), 1)], dim=1),
                      "position_ids": padded["position_ids"][:, -1:] + 1}
        out = model(input_ids=nxt[:, None], **padded, **kv)
    toks = torch.stack(new, dim=1).tolist()  # [B, n]
    return [t[: t.index(eos_id) + 1] if eos_id in t else t for t in toks]


def _exact(row: dict, text: str) -> bool:
    return text == str(row["label"])


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch: int = 256,
                    correct: Callable[[dict, str], bool] = _exact, left_pad: bool = False) -> float:
    """Share of rows whose greedy response ends with eos and is `correct` (default: exactly the label).

    Plain batched decoding for the bootstrap report only (the rollout engine is separate).
    Rows are grouped by prompt length so no padding is needed; `left_pad`: batches of `batch` rows of any prompt
    length, left-padded (`_greedy`), for long responses on a GPU, where a decode step costs about the
    same for 20 rows as for 200 and the groups by length would each decode the longest response again.
    """
    from reflow.rl.data import encode_prompt

    if not rows:
        return 0.0
    model.eval()
    prompts = encode_prompt(tokenizer, [r["prompt"] for r in rows])
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(-1 if left_pad else len(p), []).append(i)
    right, eos = 0, tokenizer.eos_token_id
    for idx in by_len.values():
        for s in range(0, len(idx), batch):
            chunk = idx[s : s + batch]
            outs = _greedy(model, [prompts[i] for i in chunk], max_new_tokens, eos, tokenizer.pad_token_id or 0)
            for i, toks in zip(chunk, outs):
                text = tokenizer.decode(toks, skip_special_tokens=True)
                right += int(bool(toks) and toks[-1] == eos and correct(rows[i], text))
    return right / len(rows)


# Model shapes of `reflow bootstrap --size`: the CPU demo's ~1M-parameter policy, and a ~113M one
# (12 layers of 768) for configs/gpu-demo.yaml, warmed up on a GPU in about a minute.
SIZES = {"tiny": {"hidden": 128, "layers": 4, "heads": 4, "mlp": 512},
         "gpu": {"hidden": 768, "layers": 12, "heads": 12, "mlp": 3072}}
# Their warm-ups (bootstrap's defaults for tiny): the larger model needs a lower rate and larger batches.
WARMUP = {"tiny": {}, "gpu": {"lr": 3e-4, "batch": 256, "steps": 3000}}


def bootstrap(out_dir: str | Path, seed: int = 0, digits: int = 2, num_train: int = 5000, num_eval: int = 200,
              steps: int = 500, batch: int = 64, lr: float = 1e-3, target_accuracy: float | None = 0.4,
              hidden: int = 128, layers: int = 4, heads: int = 4, mlp: int = 512, progress: bool = True,
              device: str = "cpu") -> dict:
    """Build the demo policy, warm it up on the train split, save it (HF folder) + bootstrap.json.

    Warm-up stops once greedy accuracy on the first `num_eval` train rows reaches
    `target_accuracy` (at most `steps` steps; None = exactly `steps`). The default 0.4 leaves a
    partially competent policy (held-out ~0.3-0.5) so that GRPO groups have mixed rewards.

    The problems are `reflow.rl.demo_task.make_problems(seed, num_train, num_eval, digits)`: an RL run
    keeps its held-out split unseen only if it uses the same data.seed / num_eval / digits.
    """

    from reflow.rl.demo_task import make_problems

    train, held_out = make_problems(seed, num_train, num_eval, digits)
    accuracy = functools.partial(greedy_accuracy, max_new_tokens=digits + 2)  # longest answer (digits + 1) plus eos
    return train_policy(out_dir, train, held_out, accuracy,
                        {"seed": seed, "digits": digits, "num_train": num_train, "num_eval": num_eval},
                        seed=seed, steps=steps, batch=batch, lr=lr, target_accuracy=target_accuracy,
                        hidden=hidden, layers=layers, heads=heads, mlp=mlp, progress=progress, device=device)


def train_policy(out_dir: str | Path, train: list[dict], held_out: list[dict], accuracy: Accuracy, report: dict, *,
                 seed: int, steps: int, batch: int, lr: float, target_accuracy: float | None, hidden: int,
                 layers: int, heads: int, mlp: int, max_positions: int = 128, check_every: int = 25,
                 batch_fn=None, progress: bool = True, device: str = "cpu", tf32: bool = False,
                 autocast: bool = False, check_below_loss: float | None = None, micro_batches: int = 1) -> dict:
    """A task's bootstrap: build the model, warm it up on `train` (`warmup`; the check on the first
    len(held_out) train rows), save it and bootstrap.json: `report` plus the held-out `accuracy`
    before and after, the warm-up's metrics and the seconds taken. Returns that report. `tf32`: on a GPU,
    float32 products on TF32 tensor cores meanwhile (the weights stay float32); `autocast`: on a GPU, the warm-up's
    forwards under bf16 autocast (the held-out scoring stays as the engine and trainer see the weights)."""
    before_precision = torch.get_float32_matmul_precision()
    if tf32 and device != "cpu":
        torch.set_float32_matmul_precision("high")
    try:
        return _train_policy(out_dir, train, held_out, accuracy, report, seed=seed, steps=steps, batch=batch, lr=lr,
                             target_accuracy=target_accuracy, hidden=hidden, layers=layers, heads=heads, mlp=mlp,
                             max_positions=max_positions, check_every=check_every, batch_fn=batch_fn,
                             progress=progress, device=device, tf32=tf32 and device != "cpu",
                             autocast=autocast and device != "cpu", check_below_loss=check_below_loss,
                             micro_batches=micro_batches)
    finally:
        torch.set_float32_matmul_precision(before_precision)


def _train_policy(out_dir, train, held_out, accuracy, report, *, seed, steps, batch, lr, target_accuracy, hidden,
                  layers, heads, mlp, max_positions, check_every, batch_fn, progress, device, tf32, autocast,
                  check_below_loss, micro_batches) -> dict:
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=hidden, layers=layers, heads=heads, mlp=mlp, max_positions=max_positions,
                        seed=seed).to(device)
    before = accuracy(model, tokenizer, held_out)
    metrics = warmup(model, tokenizer, train, steps=steps, batch=batch, lr=lr, seed=seed, progress=progress,
                     stop_accuracy=target_accuracy, check_rows=train[:len(held_out)], check_every=check_every,
                     batch_fn=batch_fn, accuracy=accuracy, autocast=autocast, check_below_loss=check_below_loss,
                     micro_batches=micro_batches)
    after = accuracy(model, tokenizer, held_out)
    out = save_policy(model.cpu(), tokenizer, out_dir)
    report = {**report, "eval_accuracy_before": before, "eval_accuracy_after": after,
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "warmup": metrics, "seconds": time.perf_counter() - t0, "path": str(out), "device": device,
              "tf32": tf32, "autocast": "bf16" if autocast else None}
    (out / "bootstrap.json").write_text(json.dumps(report, indent=2))
    return report
