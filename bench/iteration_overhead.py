"""Iteration breakdown and framework overhead: the real train flow next to a bare loop doing the same work.

    .venv/bin/python bench/iteration_overhead.py                 # small and large configs, ~5 min on 2 cores
    .venv/bin/python bench/iteration_overhead.py --sizes large --iters 4
    .venv/bin/python bench/iteration_overhead.py --sizes small --baseline /tmp/base  # + the code at /tmp/base

Configurations (CONFIGS): "small" is the demo policy (1.1M parameters) at 4 prompts x 8 samples with
the demo's own save and eval schedule (none between the first and the last iteration): the fixed
per-iteration cost at its most visible. "demo" (32 x 8) and "large" (25M parameters, 32 x 8) save
and evaluate after every iteration. "large10" is "large" on a schedule closer to real runs: both loops
save and evaluate after every 10th iteration; its figures are means over 10 measured iterations
(one save and one eval among them), not medians.

"full" is the real thing: `reflow.flows.train.train` (Prefect flow, one `iteration` subflow per iteration,
Ray actors: embedded engine over HTTP, DeepSpeed trainer rank) with configs/demo.yaml. Stage seconds
are the iteration flow's own `time_<stage>` metrics; save and eval are timed around the parent flow's
calls; total = from one iteration's start in the parent flow to the next one's (everything the parent
does per iteration); orchestration = total minus the stages (Prefect flow/task runs, Ray scheduling,
logging). fixed = total minus the compute stages (all but report): what the iteration spends on
bookkeeping. With --baseline DIR a third run takes the full flow's code from DIR (a copy of another
commit, e.g. `git archive HEAD | tar -x -C DIR`), in the same script run.

"bare" is the same work in one process with no Ray, Prefect, HTTP or DeepSpeed: the same
prompts, per-sample seeds and sampling through the same `Generator`, the same reward function,
GRPO advantages and PPO-clip loss (rl/), a torch AdamW step with the same clipping, weights copied
into the engine's model in place, the same records (metrics.json, rollouts.parquet), a checkpoint
(HF folder + optimizer state) and the same greedy eval of 200 held-out prompts.

Both run as child processes of this script, one after the other, so each one's peak memory is its own;
`--rounds` pairs of them in ABBA order (bare, full, full, bare, ...), their iterations pooled, because this
VM's speed drifts within minutes; the first `--warmup` iterations of each child are not counted. Policies are randomly
initialised (a warmed-up policy would only change response lengths, equally for both).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from _trees import importable  # noqa: E402

DEMO_MODEL = dict(hidden=128, layers=4, mlp=512)
LARGE_MODEL = dict(hidden=512, layers=6, mlp=2048)
CONFIGS: dict[str, dict] = {  # model shape, prompts per iteration, save + eval every this many iterations (None: last only)
    "small": dict(model=DEMO_MODEL, prompts=4, every=None),
    "demo": dict(model=DEMO_MODEL, prompts=32, every=1),
    "large": dict(model=LARGE_MODEL, prompts=32, every=1),
    "large10": dict(model=LARGE_MODEL, prompts=32, every=10, iters=10),  # iters: measured, whatever --iters says
}
# The bare loop takes one optimizer step per iteration over micro-batches of 256: both loops are held to it,
# whatever configs/demo.yaml's default (4 steps since 2026-12-01, bench/RESULTS.md 10a).
ONE_STEP = ["trainer.minibatches_per_iteration=1", "trainer.micro_batch_size=256"]
STAGES = ("generate", "reward", "advantages", "train", "push", "report", "save", "eval")
COMPUTE = tuple(s for s in STAGES if s != "report")
DEMO_YAML = C.ROOT / "configs" / "demo.yaml"


# ---------------------------------------------------------------- full: the real flow


def _schedule(every: int | None) -> list[str]:
    """Overrides: no eval before training; save and eval every `every` iterations, or only after the last."""
    return ["eval.before_train=false", "checkpoint.save_every_minutes=null"] + (
        [f"eval.interval={every}", f"checkpoint.save_interval={every}"] if every else ["eval.interval=null"])


def _n_run(args) -> int:
    """Iterations run: warm-up + measured, and one more unless every iteration saves and evaluates (the
    last iteration always saves and evaluates: it is not counted then)."""
    return args.warmup + args.iters + (0 if CONFIGS[args.config]["every"] == 1 else 1)


def run_full(args) -> dict:
    import ray

    import reflow.flows.train as ft

    try:
        from reflow.infra.cluster.runtime import shutdown_runtime
        from reflow.infra.config.schema import load_config
    except ImportError:  # a baseline tree from before infra/ was split by concern (issue 53)
        from reflow.infra.config import load_config  # type: ignore[no-redef]
        from reflow.infra.runtime import shutdown_runtime  # type: ignore[no-redef]

    try:  # the train flow calls run_iteration from its session (older trees: flows/recovery.py, or directly)
        from reflow.flows import session as recovery
    except ImportError:
        try:
            from reflow.flows import recovery
        except ImportError:
            recovery = ft

    work = Path(tempfile.mkdtemp(prefix="reflow-bench-full-"))
    exp = f"bench-{os.getpid()}"
    conf = CONFIGS[args.config]
    cfg = load_config(str(DEMO_YAML), _schedule(conf["every"]) + ONE_STEP + [
        f"model.path={args.policy}", f"experiment={exp}", f"num_iterations={_n_run(args)}",
        "checkpoint.keep_last=1", f"rollout.prompts_per_iteration={conf['prompts']}",
        f"storage.root=file://{work}/runs", f"rollout.engine_threads={args.threads}",
        f"trainer.threads_per_rank={args.threads}", "resume=never", *args.override])
    marks: list[tuple[str, float, float]] = []  # (kind, start, end) of every hooked call

    def timed(kind, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                marks.append((kind, t0, time.perf_counter()))
        wrapper._bench_timed = True  # type: ignore[attr-defined]  # one hook per function
        return wrapper

    # Timing hooks only: the flow looks these names up in its module at call time.
    hooks = [(recovery, "run_iteration", "iteration"), (ft, "run_iteration", "iteration"), (ft, "iteration", "iteration")]
    hooks += [(m, name, kind) for m in {ft, recovery} for name, kind in (("_save", "save"), ("evaluate", "eval"),
                                                                       ("launch_eval", "eval"), ("collect", "eval"))]
    if hasattr(recovery, "RunSession"):  # the session's save is a method
        hooks.append((recovery.RunSession, "save", "save"))
    for module, name, kind in hooks:
        if hasattr(module, name) and not hasattr(getattr(module, name), "_bench_timed"):
            setattr(module, name, timed(kind, getattr(module, name)))
    cpu0 = {k: c for k, _, _, c in C.process_tree_usage()}  # none yet: Ray and Prefect start inside train
    t_run = time.perf_counter()
    summary = ft.train(cfg, release_cluster=False)
    usage = C.process_tree_usage()
    peaks = [(k, n, m) for k, n, m, _ in usage]
    cpu = {"wall": time.perf_counter() - t_run, **{k: c - cpu0.get(k, 0.0) for k, _, _, c in usage}}
    shutdown_runtime(exp)
    ray.shutdown()
    stored = [json.loads(f.read_text()) for f in sorted((work / "runs" / exp / "iterations").glob("*/metrics.json"))]
    shutil.rmtree(work, ignore_errors=True)
    rows = _full_rows(args, marks, summary["history"], stored)
    return {"rows": rows, "peak_self_mib": C.self_peak_mib(), "peaks": peaks, "cpu": cpu}


def _full_rows(args, marks: list[tuple[str, float, float]], history: list[dict], stored: list[dict]) -> list[dict]:
    """One row per measured iteration: its stages, save and eval, its window in the parent flow and
    what its metrics say about orchestration (`stored`: the metrics.json files, in iteration order)."""
    starts = [t0 for kind, t0, _ in marks if kind == "iteration"]
    rows = []
    for i in range(args.warmup, args.warmup + args.iters):
        # iteration i's window: from its start to the next one's (the last: to the last hooked call's end)
        lo, hi = starts[i], starts[i + 1] if i + 1 < len(starts) else max(t1 for _, _, t1 in marks)
        m = history[i]
        row = {s: m[f"time_{s}"] for s in STAGES if f"time_{s}" in m}
        for kind in ("save", "eval"):
            row[kind] = sum(t1 - t0 for k, t0, t1 in marks if k == kind and lo <= t0 < hi)
        row["total"] = hi - lo
        row["push_send"], row["push_verify"] = m.get("push_seconds", 0.0), m.get("push_verify_seconds", 0.0)
        for key in ("time_iteration", "time_orchestration", "flow_run_start_seconds", "flow_run_end_seconds",
                    "train_stage_records_wait_seconds"):
            row[key] = m.get(key, float("nan"))
        row["records_seconds"] = stored[i].get("records_seconds", float("nan"))  # known only to metrics.json
        rows.append(row)
    return rows


# ---------------------------------------------------------------- bare: one process, plain torch


def _bare_setup(args):
    import torch

    from reflow.engines.embedded.generator import Generator
    from reflow.engines.hf_io import load_causal_lm, load_tokenizer
    from reflow.infra.config.schema import load_config
    from reflow.rl.data import load_prompt_rows, tokenize_prompts
    from reflow.rl.rewards import load_reward_fn

    torch.set_num_threads(args.threads)
    cfg = load_config(str(DEMO_YAML), ONE_STEP + [f"model.path={args.policy}",
                                       f"rollout.prompts_per_iteration={CONFIGS[args.config]['prompts']}"])
    tok = load_tokenizer(args.policy)
    policy = load_causal_lm(args.policy)  # trained copy
    policy.eval()  # dropout off, as the trainer does
    gen = Generator(load_causal_lm(args.policy), tok, max_batch_size=cfg.rollout.max_batch_size)  # engine copy
    d = cfg.data
    train_rows, eval_rows = load_prompt_rows(d.task, d.path, d.prompt_key, d.label_key, d.seed, d.num_train,
                                             d.num_eval, d.digits)
    t = cfg.trainer
    opt = torch.optim.AdamW(policy.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    return (cfg, tok, policy, gen, opt, load_reward_fn(d.reward_fn),
            tokenize_prompts(train_rows, tok, d.max_prompt_len), tokenize_prompts(eval_rows, tok, d.max_prompt_len))


def _bare_generate(cfg, gen, tok, prompts, it: int, greedy: bool = False):
    from reflow.engines.rollout_stages import sample_seeds, sampling_params
    from reflow.rl.data import PromptSampler
    from reflow.rl.types import RolloutBatch

    r = cfg.rollout
    if greedy:
        chosen, n = prompts, 1
        sps = sampling_params(0.0, 1.0, -1, r.max_new_tokens, [tok.eos_token_id])
        recs = gen.generate([p.input_ids for p in chosen], sps, 1)
    else:  # the flow's prompt order and per-sample seeds (reflow.tasks.rollout / reflow.engines.rollout_client)
        k, n = r.prompts_per_iteration, r.n_samples_per_prompt
        epoch, cursor = divmod(it * k, len(prompts))
        sampler = PromptSampler(prompts, cfg.data.seed)
        sampler.load_state_dict({"epoch": epoch, "cursor": cursor})
        chosen = sampler.next_batch(k)
        sp = sampling_params(r.temperature, r.top_p, r.top_k, r.max_new_tokens, [tok.eos_token_id])
        seeds = sample_seeds(cfg.seed, it, k * n)
        ids = [p.input_ids for p in chosen for _ in range(n)]
        recs = gen.generate(ids, [{**sp, "sampling_seed": s} for s in seeds], 1)
    gi = [i // n for i in range(len(recs))]
    return RolloutBatch(group_index=gi, prompt_text=[chosen[g].text for g in gi],
                        prompt_ids=[chosen[g].input_ids for g in gi], response_text=[o["text"] for o in recs],
                        response_ids=[o["output_ids"] for o in recs],
                        rollout_logprobs=[[lp[0] for lp in o["output_token_logprobs"]] for o in recs],
                        finish_reason=[o["finish_reason"]["type"] for o in recs], label=[chosen[g].label for g in gi],
                        policy_version=it)


def _bare_train(cfg, policy, opt, batch, pad_id: int) -> float:
    import torch

    from reflow.rl.losses import aggregate, entropy_from_logits, policy_loss, token_logprobs
    from reflow.rl.types import to_train_tensors

    t, a, temp = cfg.trainer, cfg.algorithm, cfg.rollout.temperature
    x = to_train_tensors(batch, pad_id)
    B, mbs = x["input_ids"].shape[0], t.micro_batch_size

    def rows(s, e):
        L = max(int(x["attention_mask"][s:e].sum(1).max()), 2)
        return {k: v[s:e] if v.dim() == 1 else v[s:e, :L] if k in ("input_ids", "attention_mask") else v[s:e, :L - 1]
                for k, v in x.items()}

    def logits(mb):
        return policy(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits[:, :-1]

    old = torch.zeros_like(x["loss_mask"])  # [B, T-1]
    with torch.no_grad():
        for s in range(0, B, mbs):
            mb = rows(s, min(s + mbs, B))
            old[s:s + mbs, :mb["input_ids"].shape[1] - 1] = token_logprobs(logits(mb), mb["input_ids"][:, 1:], temp)
    x["old_logprobs"] = old
    units = x["loss_mask"].sum().clamp_min(1.0)
    for s in range(0, B, mbs):
        mb = rows(s, min(s + mbs, B))
        lg = logits(mb)
        logp = token_logprobs(lg, mb["input_ids"][:, 1:], temp)
        pg, _ = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], a.clip_eps_low,
                            a.clip_eps_high, a.loss_agg)
        with torch.no_grad():
            aggregate(entropy_from_logits(lg), mb["loss_mask"], a.loss_agg)  # the trainer's entropy metric
        (pg * mb["loss_mask"].sum() / units).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(pg.detach())


def _bare_save_eval(cfg, tok, policy, gen, opt, reward_fn, eval_prompts, work: Path, d: Path, it: int,
                    mark) -> None:
    """The per-iteration checkpoint (HF folder + optimizer state) and greedy held-out eval."""
    import torch

    from reflow.engines.rollout_stages import rollout_table
    from reflow.rl.rewards import compute_rewards

    t0 = time.perf_counter()
    ck = work / "checkpoint"
    shutil.rmtree(ck, ignore_errors=True)
    policy.save_pretrained(ck)
    tok.save_pretrained(ck)
    torch.save({"optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, ck / "optim.pt")
    t0 = mark("save", t0)
    ev = _bare_generate(cfg, gen, tok, eval_prompts, it, greedy=True)
    acc = compute_rewards(reward_fn, ev.prompt_text, ev.response_text, ev.label)
    rollout_table(ev).to_parquet(d / "heldout.parquet")
    (d / "eval.json").write_text(json.dumps({"eval_accuracy": sum(acc) / len(acc)}))
    mark("eval", t0)


def run_bare(args) -> dict:
    import torch

    from reflow.engines.rollout_stages import rollout_table
    from reflow.rl.rewards import compute_rewards

    cfg, tok, policy, gen, opt, reward_fn, prompts, eval_prompts = _bare_setup(args)
    work = Path(tempfile.mkdtemp(prefix="reflow-bench-bare-"))
    rows = []
    for it in range(args.warmup + args.iters):
        sec: dict[str, float] = {}
        t_it = time.perf_counter()

        def mark(stage, t0):
            sec[stage] = time.perf_counter() - t0
            return time.perf_counter()

        t0 = time.perf_counter()
        batch = _bare_generate(cfg, gen, tok, prompts, it)
        t0 = mark("generate", t0)
        batch = batch.with_(rewards=compute_rewards(reward_fn, batch.prompt_text, batch.response_text, batch.label))
        t0 = mark("reward", t0)
        batch, _ = cfg.algorithm.spec.advantages(batch, cfg.algorithm)
        t0 = mark("advantages", t0)
        loss = _bare_train(cfg, policy, opt, batch, tok.pad_token_id)
        t0 = mark("train", t0)
        with torch.no_grad():
            gen.load_named_tensors([(n, p.detach()) for n, p in policy.named_parameters()])
        t0 = mark("push", t0)
        d = work / "iterations" / f"{it:06d}"
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps({"iteration": it, "loss": loss, **sec}))
        rollout_table(batch).to_parquet(d / "rollouts.parquet")
        mark("report", t0)
        every = CONFIGS[args.config]["every"]
        if every and (it + 1) % every == 0:  # the flow's schedule (flows/schedule.py save_due, eval_due)
            _bare_save_eval(cfg, tok, policy, gen, opt, reward_fn, eval_prompts, work, d, it, mark)
        sec["total"] = time.perf_counter() - t_it
        if it >= args.warmup:
            rows.append(sec)
    shutil.rmtree(work, ignore_errors=True)
    return {"rows": rows, "peak_self_mib": C.self_peak_mib(), "peaks": []}


# ---------------------------------------------------------------- parent: run both, print the table


def _child(args, part: str, config: str, policy: Path, out: Path, log: Path, code: str | None = None) -> dict:
    iters = CONFIGS[config].get("iters", args.iters)
    cmd = [sys.executable, __file__, "--part", part, "--config", config, "--policy", str(policy), "--json", str(out),
           "--iters", str(iters), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    cmd += [f"--override={o}" for o in args.override]
    env = {**os.environ, **C.BENCH_ENV, "PREFECT_HOME": str(out.parent / f"prefect-{out.stem}"),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    if code:  # the baseline's `reflow` package first, for this process and its Ray workers
        env["PYTHONPATH"] = code
        cmd += ["--code", code]
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=code or C.ROOT).returncode
    if rc != 0:
        sys.stdout.write(log.read_text()[-6000:])
        raise SystemExit(f"{part} run failed (exit {rc}); log above and in {log}")
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def _paired(args, config: str, policy: Path, work: Path) -> dict[str, dict]:
    """The bare and the full child, `--rounds` times in ABBA order (bare, full | full, bare | ...), their rows
    pooled. This VM's speed drifts by up to ~25 % within minutes (the same train step: 3.3 s in one child, 4.3 s
    in another a few minutes later), so one bare-then-full pair can report drift as overhead; alternating the
    order cancels a steady drift and the spread of the per-round ratios shows what is left."""
    runs: dict[str, dict] = {}
    ratios = []
    for r in range(args.rounds):
        parts = ("bare", "full") if r % 2 == 0 else ("full", "bare")
        got = {part: _child(args, part, config, policy, work / f"{config}-{part}-{r}.json",
                            work / f"{config}-{part}-{r}.log") for part in parts}
        ratios.append(statistics.mean(x["total"] for x in got["full"]["rows"])
                      / statistics.mean(x["total"] for x in got["bare"]["rows"]))
        for part, res in got.items():
            if part in runs:
                runs[part]["rows"] += res["rows"]
            else:
                runs[part] = res
    runs["full"]["round_ratios"] = ratios
    return runs


def _median(rows: list[dict], key: str, mean: bool = False) -> float:
    """Median over iterations (robust to a burst of load from other processes on a shared machine); the
    mean where a save and an eval fall in one iteration of several (their cost spread over all)."""
    avg = statistics.mean if mean else statistics.median
    if key == "orchestration":
        return avg(r["total"] - sum(r.get(s, 0.0) for s in STAGES) for r in rows)
    if key == "fixed":
        return avg(r["total"] - sum(r.get(s, 0.0) for s in COMPUTE) for r in rows)
    return avg(r.get(key, 0.0) for r in rows)


def _report(config: str, nparams: int, runs: dict[str, dict]) -> dict[str, float]:
    """Prints the table; returns full/bare of the whole iteration and full's fixed seconds."""
    full, bare = runs["full"], runs["bare"]
    every = CONFIGS[config]["every"]
    mean = bool(every and every > 1)
    out = []
    for stage in STAGES + ("orchestration", "fixed", "total"):
        row = {k: _median(r["rows"], stage, mean) for k, r in runs.items()}
        row |= {"stage": stage, "ratio": row["full"] / row["bare"] if row["bare"] > 1e-3 else float("nan"),
                "share": row["full"] / _median(full["rows"], "total", mean)}
        out.append(row)
    sched = {None: "save + eval after the last iteration only", 1: "save + eval every iteration"}.get(
        every, f"save + eval every {every} iterations")
    print(f"\n## {config}: {nparams / 1e6:.1f}M parameters, {CONFIGS[config]['prompts']} prompts x 8 samples, {sched}; "
          f"seconds per iteration, {'mean' if mean else 'median'} of {len(full['rows'])} (after "
          f"{full.get('warmup', 1)} warm-up)")
    cols = [("stage", "stage", ""), ("full", "full s", ".3f"), ("bare", "bare s", ".3f"),
            ("ratio", "full/bare", ".2f"), ("share", "share of full", ".1%")]
    if "baseline" in runs:
        cols.insert(1, ("baseline", "baseline s", ".3f"))
    print(C.table(out, cols))
    if len(full.get("round_ratios", [])) > 1:
        print("full/bare of each round (mean totals, ABBA order): "
              + " ".join(f"{x:.2f}" for x in full["round_ratios"]))
    med = lambda key: _median(full["rows"], key, mean)  # noqa: E731
    send, verify = med("push_send"), med("push_verify")
    print(f"full push: {send:.3f}s sending (weight_push), {verify:.3f}s verifying (sampled tensors read back "
          f"over HTTP), {med('push') - send - verify:.3f}s the rest (task, gather, Ray call)")
    print(f"full, as stored in metrics.json: time_iteration {med('time_iteration'):.3f}s, time_orchestration "
          f"{med('time_orchestration'):.3f}s (flow run start {med('flow_run_start_seconds'):.3f}s, end "
          f"{med('flow_run_end_seconds'):.3f}s); background record writing {med('records_seconds'):.3f}s; train "
          f"waiting for the stage records {med('train_stage_records_wait_seconds'):.3f}s")
    print(f"peak RSS full: {C.fmt_peaks(full['peaks'], full['peak_self_mib'])}")
    print(f"peak RSS bare: this process {bare['peak_self_mib']:.0f} MiB")
    cpu = full.get("cpu", {})
    if cpu:
        busy = sorted(((k, v) for k, v in cpu.items() if k != "wall"), key=lambda kv: -kv[1])
        print(f"CPU seconds of the full run's other processes over its {cpu['wall']:.0f}s (2 cores = "
              f"{2 * cpu['wall']:.0f} CPU-s): " + ", ".join(f"{k} {v:.0f}" for k, v in busy[:7]))
    return {"full_over_bare": out[-1]["ratio"], "fixed": out[-2]["full"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,large", help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--iters", type=int, default=3, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=1, help="iterations run first and not counted")
    p.add_argument("--rounds", type=int, default=2, help="bare/full pairs per size, in ABBA order (this VM's speed "
                                                         "drifts within minutes: pooled rows, the spread printed)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine and trainer (both runs)")
    p.add_argument("--baseline", default=None, help="also run the full flow with the code of this folder (a copy of "
                                                    "another commit's tree)")
    p.add_argument("--override", action="append", default=[], help="a config override for the full runs (repeatable), "
                                                                      "e.g. cluster.num_cpus=4")
    p.add_argument("--part", choices=["all", "full", "bare"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--config", default="small", help=argparse.SUPPRESS)
    p.add_argument("--code", default=None, help=argparse.SUPPRESS)
    p.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    C.set_bench_env()
    if args.part != "all":
        if args.code:
            sys.path.insert(0, args.code)
        res = run_full(args) if args.part == "full" else run_bare(args)
        res["warmup"] = args.warmup
        Path(args.json).write_text(json.dumps(res))
        return
    C.header("iteration breakdown: train flow (Prefect + Ray + DeepSpeed + HTTP engine) vs a bare loop")
    work = Path(tempfile.mkdtemp(prefix="reflow-bench-iter-"))
    results = {}
    try:
        for config in args.sizes.split(","):
            policy = C.demo_policy(work / f"policy-{config}", **CONFIGS[config]["model"])
            runs = _paired(args, config, policy, work)
            if args.baseline:
                code = str(importable(Path(args.baseline).resolve()))
                runs["baseline"] = _child(args, "full", config, policy, work / f"{config}-baseline.json",
                                          work / f"{config}-baseline.log", code)
            results[config] = _report(config, C.n_params(policy), runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nfull/bare per iteration: " + " ".join(f"{k}={v['full_over_bare']:.2f}" for k, v in results.items()))
    small, large = results.get("small", {}), results.get("large", {})
    extra = f" large10_full_over_bare={results['large10']['full_over_bare']:.2f}" if "large10" in results else ""
    print(f"iteration_overhead: small_fixed_s={small.get('fixed', float('nan')):.3f} "
          f"large_full_over_bare={large.get('full_over_bare', float('nan')):.2f}{extra}")


if __name__ == "__main__":
    main()
