"""`reflow` command line: bootstrap the demo policy, train, run the demo, check a config.

A user error (a bad config, a missing file or column, a reward function that does not import or
score, before or during the run, unreachable storage, a Prefect server that does not start) ends the command
with one `reflow: ...` line naming the field or file and the fix, and exit code 2; `--debug` raises it
instead, with its traceback. `train` and `demo` run the preflight (infra/ops/preflight.py) before Ray
starts and before any flow runs (Prefect's temporary server, where one is used, starts meanwhile and is
stopped when the preflight fails); `config --check` runs it alone."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from reflow.infra.ops import console
from reflow.infra.store import signing

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
TOOLS_DEMO_CONFIG = DEMO_CONFIG.with_name("demo-tools.yaml")  # `reflow demo --task tools`
GPU_DEMO_CONFIG = DEMO_CONFIG.with_name("gpu-demo.yaml")  # `reflow demo --gpu`: a ~113M policy, 3-digit addition
# `reflow demo --task scratchpad [--gpu]`: long multiplication worked out step by step (reflow.rl.scratchpad_task)
SCRATCHPAD_CONFIG = DEMO_CONFIG.with_name("demo-scratchpad.yaml")
GPU_SCRATCHPAD_CONFIG = DEMO_CONFIG.with_name("gpu-scratchpad.yaml")
ADDITION_POLICY = ".reflow/models/demo-policy"  # configs/demo.yaml's model.path, where `reflow bootstrap` writes
DEMO_DATA = ".reflow/data/demo"  # the fixed eval file and new data configs/demo-retrain.yaml and the README name
OVERRIDES_HELP = ("config overrides as dotted key=value pairs, validated like the file, "
                  "e.g. trainer.lr=1e-4 rollout.n_samples_per_prompt=8 num_iterations=5")
VERBOSE_HELP = ("show every Prefect log line (each task's state) instead of a progress bar with warnings "
                "and errors")
FLOW_COMMANDS = {"demo", "train", "evaluate"}
USER_ERROR_EXIT = 2  # like argparse's own usage errors: the command was wrong, not the program
DEBUG_HELP = "on a user error, raise it with its traceback instead of printing one line"
JSON_HELP = ("print the whole result as JSON on stdout (iterations, every eval, every iteration's metrics, timings) "
             "instead of the short summary")
RESULT_FILE_HELP = "also write the whole result as JSON to this file (its folder is created)"
RESUME_HELP = ("auto (default): continue from the experiment's latest committed checkpoint; never: start "
               "fresh; or a checkpoint URL (…/checkpoints/iter_NNNNNN). Same as the override resume=…")


class UsageError(ValueError):
    """A command given something it cannot work with; the message says what to give instead."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """What the CLI reports as one line: errors whose message names the input and the fix."""
    from reflow.infra.cluster.ray_head import ClusterError
    from reflow.infra.config.schema import ConfigError
    from reflow.infra.ops.preflight import PreflightError

    return ConfigError, PreflightError, console.ServerStartError, ClusterError, UsageError


def _config(path: str | None, overrides: list[str]):
    from reflow.infra.config.schema import load_config

    return load_config(path, overrides)


def _preflight(cfg) -> list[str]:
    from reflow.infra.ops.preflight import preflight

    return preflight(cfg)


def _warnings(cfg) -> list[str]:
    from reflow.infra.ops.preflight import warnings_for

    return warnings_for(cfg)


def cmd_config(args) -> None:
    from reflow.infra.config.schema import dump_config

    cfg = _config(args.config, args.overrides)
    if args.check:
        t0 = time.perf_counter()
        passed = _preflight(cfg)
        print(f"reflow: preflight passed in {time.perf_counter() - t0:.1f} s:", file=sys.stderr)
        for line in passed:
            print(f"  {line}", file=sys.stderr)
        for line in _warnings(cfg):  # the run logs these as warnings; they do not fail the check
            print(f"reflow: warning: {line}", file=sys.stderr)
    print(dump_config(cfg), end="")


def cmd_bootstrap(args) -> None:
    from reflow.rl.demo_policy import SIZES, WARMUP, bootstrap

    kw = {k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("batch", args.batch),
                            ("target_accuracy", args.target_accuracy)) if v is not None}
    device = args.device if args.device != "auto" else ("cuda" if _cuda() else "cpu")
    out, data_out = bootstrap_folders(args)
    if args.task == "scratchpad":
        if not data_out:
            raise UsageError("reflow bootstrap --task scratchpad trains on its data files: give --data-out a folder "
                             "(or leave it out for the default)")
        print(json.dumps(_scratchpad_bootstrap(args.seed, args.size, device, out, data_out, **kw), indent=2))
        return
    report = bootstrap(out, seed=args.seed, digits=args.digits, device=device, **SIZES[args.size],
                       **{**WARMUP[args.size], **kw})
    if data_out:
        report["data"] = _demo_data(data_out, args.seed, args.digits)
    print(json.dumps(report, indent=2))


def bootstrap_folders(args) -> tuple[str, str]:
    """`reflow bootstrap`'s (policy folder, data folder): the ones given, else the task's defaults, which its
    config names for seed 0 (configs/demo.yaml; configs/demo-scratchpad.yaml, gpu-scratchpad.yaml by --size)."""
    if args.task == "scratchpad":
        return (args.out or str(_scratchpad_policy(args.seed, args.size)),
                str(_scratchpad_data(args.seed, args.size)) if args.data_out is None else args.data_out)
    return args.out or ADDITION_POLICY, DEMO_DATA if args.data_out is None else args.data_out


def _scratchpad_bootstrap(seed: int, size: str, device: str, out: str | None = None, data_out: str | None = None,
                          **warmup) -> dict:
    """The scratchpad task's data files and policy (reflow.rl.scratchpad_demo), each in its default folder
    unless given; the bootstrap's report with the files under "data"."""
    from reflow.rl.scratchpad_demo import bootstrap_scratchpad, write_scratchpad_data

    data = write_scratchpad_data(data_out or _scratchpad_data(seed, size), seed, size)
    return bootstrap_scratchpad(out or _scratchpad_policy(seed, size), data, seed=seed, size=size, device=device,
                                **warmup)


def _scratchpad_policy(seed: int, size: str) -> Path:
    return Path(f".reflow/models/scratchpad-{size}-s{seed}")


def _scratchpad_data(seed: int, size: str) -> Path:
    return Path(f".reflow/data/scratchpad-{size}-s{seed}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _demo_data(folder: str, seed: int, digits: int) -> dict[str, str]:
    """The retrain walkthrough's files (reflow.rl.demo_task.write_demo_data), written once."""
    from reflow.rl.demo_task import write_demo_data

    found = {"heldout": str(Path(folder, "heldout.jsonl")), "incoming": str(Path(folder, "incoming"))}
    return found if Path(found["heldout"]).is_file() else write_demo_data(folder, seed=seed, digits=digits)


def _resume_override(args) -> list[str]:
    return [f"resume={args.resume}"] if getattr(args, "resume", None) else []


def _terminal(args, cfg):
    """console.terminal for `train` and `demo`: the preflight runs while Prefect's temporary server starts
    (a bad input still ends the command with one line, and the server is stopped), then Ray starts (or is
    attached to) while the server finishes starting; the flow's runtime finds Ray up. They ran one after
    another before (~40 s of a GPU run's start, bench/RESULTS.md 16); this VM: 0.94x to the first iteration
    (RESULTS.md 18; not yet measured on a GPU).
    With cluster.start_early (auto: on a GPU machine) Ray starts beside the preflight instead, and the run's
    actors as soon as Ray is up (infra/runtime.begin_runtime), while the preflight, the server and the flow run
    start; a failed preflight stops that Ray and the actors with it."""
    from reflow.infra.cluster.ray_connect import EarlyConnect
    from reflow.infra.cluster.runtime import forget_ahead

    early = EarlyConnect.begin(cfg, args.verbose, then=lambda: _begin_runtime(cfg, beside_preflight=True))

    def abandon() -> None:
        if early is not None:
            early.join()  # the runtime's build has begun (or Ray's start failed)
            forget_ahead(cfg)  # ... and ended: no Ray call of its thread spans the shutdown that follows
            early.abandon()

    return console.terminal(args.verbose, preflight=lambda: _preflight(cfg), meanwhile=lambda: _connect_ray(cfg, early),
                            abandon=abandon if early is not None else None)


def _connect_ray(cfg, early=None) -> None:
    """Ray for the flow's runtime, started while Prefect's server finishes starting (or joined: `early` started
    it beside the preflight, and then the actors begin too); not when the run's checkpoint already reached
    num_iterations (the flow then trains nothing and starts no cluster)."""
    from reflow.infra.cluster.ray_connect import connect_for, namespace_for

    done = _already_done(cfg)
    if early is not None and (description := early.join()) is not None:
        logging.getLogger("reflow.ray").info(description)
        if early.then_result:  # logged now: the terminal shows no log line before the preflight passed
            logging.getLogger("reflow.runtime").info("the run's actors began beside the preflight")
        elif not done:
            _begin_runtime(cfg)
        return
    if done:
        return
    logging.getLogger("reflow.ray").info(
        connect_for(cfg.cluster, namespace_for(cfg.cluster.namespace_prefix, cfg.experiment)))


def _begin_runtime(cfg, beside_preflight: bool = False) -> bool:
    """The run's actors, built from now on in the background (infra/runtime.begin_runtime; the flow takes them);
    not when the run's checkpoint already reached num_iterations. Returns whether they began."""
    from reflow.infra.cluster.runtime import begin_runtime

    if beside_preflight:  # no log line: the terminal shows none before the preflight passed (_connect_ray says it)
        return not _already_done(cfg) and begin_runtime(cfg)
    if begin_runtime(cfg):
        logging.getLogger("reflow.runtime").info("starting the run's actors while the flow run begins")
        return True
    return False


def _already_done(cfg) -> bool:
    """A guess from the `latest` pointer (or the resume URL's name) alone; the flow decides from the verified
    checkpoints. A wrong guess costs only the overlap (Ray then starts in the flow), or an idle start."""
    from reflow.engines.storage_access import StorageError
    from reflow.infra.store import checkpoint as ckpt
    from reflow.infra.store.storage import ExperimentStore

    if cfg.resume == "never":
        return False
    if cfg.resume != "auto":
        step = ckpt.step_of(cfg.resume.rstrip("/").rpartition("/")[2])
    else:
        try:
            step = ckpt.latest_step(ExperimentStore.from_config(cfg.storage, cfg.experiment))
        except (StorageError, OSError, ValueError):  # deliberate: the flow's own storage check says what is wrong
            return False
    return step is not None and step >= cfg.num_iterations


def _emit(args, result: dict, lines: list[str]) -> None:
    """The command's end: `lines` (a short summary), or with --json the whole result as JSON on stdout instead;
    --result-file writes that JSON to a file either way."""
    text = json.dumps(result, indent=2, default=str)
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    print(text if args.json else "\n".join(lines))


def _passes(by_set: dict[str, dict]) -> str:
    """`heldout pass@1 0.455, other pass@1 0.310` for one eval point ({eval set: summary})."""
    return ", ".join(f"{name} pass@1 {s['pass@1']:.3f}" for name, s in by_set.items() if "pass@1" in s) or "no pass@1"


def _where(cfg) -> str:
    """Where the experiment's checkpoints and records are, and the key that signs its checkpoints."""
    from reflow.infra.store.storage import ExperimentStore

    store = ExperimentStore.from_config(cfg.storage, cfg.experiment)
    key = signing.key_location(cfg.experiment, cfg.checkpoint.signing_key_secret)
    return (f"checkpoints: {store.url('checkpoints')}; records (iterations, evals, rollouts): {store.url()}; "
            f"checkpoints signed with the key in {key}")


def _train_lines(cfg, summary: dict, seconds: float) -> list[str]:
    """`reflow train`'s short summary: iterations, the last reward and eval, where things are, wall time."""
    if summary.get("already_complete"):
        return [f"reflow: {summary['message']}"]
    n, start, history, evals = summary["iterations"], summary["start"], summary["history"], summary["evals"]
    lines = [f"reflow: trained iterations {start}-{start + n - 1} ({n} in this run; num_iterations="
             f"{cfg.num_iterations}) in {seconds:.0f} s" if n else "reflow: no iteration trained"]
    if history:
        lines.append(f"reflow: last iteration's reward_mean {float(history[-1].get('reward_mean', float('nan'))):.3f}")
    if evals:
        first, last = min(evals), max(evals)
        before = f" (policy version {first}: {_passes(evals[first])})" if first < last else ""
        lines.append(f"reflow: eval of policy version {last}: {_passes(evals[last])}{before}")
    return [*lines, f"reflow: {_where(cfg)}", "reflow: the whole result as JSON: --json or --result-file PATH"]


def cmd_train(args) -> None:
    t0 = time.perf_counter()
    cfg = _config(args.config, args.overrides + _resume_override(args))
    with _terminal(args, cfg):
        from reflow.flows.train import train  # Prefect reads its settings once, on import: after terminal()

        summary = train(cfg)
    _emit(args, summary, _train_lines(cfg, summary, time.perf_counter() - t0))


def cmd_evaluate(args) -> None:
    t0 = time.perf_counter()
    cfg = _config(args.config, args.overrides)
    with console.terminal(args.verbose):  # Ray starts in the flow: the eval runtime's namespace is its own
        from reflow.flows.evaluate import evaluate  # after terminal(), as in cmd_train

        summary = evaluate(cfg, checkpoint=args.checkpoint)
    _emit(args, summary, [
        f"reflow: evaluated {summary['checkpoint']} (policy version {summary['step']}) in "
        f"{time.perf_counter() - t0:.0f} s: {_passes(summary['evals'])}",
        *(f"reflow:   {name}: reward_mean {s['reward_mean']:.3f} over {s['prompts']} prompts, {s['samples']} samples"
          for name, s in summary["evals"].items() if {"reward_mean", "prompts", "samples"} <= s.keys()),
        f"reflow: records: {summary['records']}", "reflow: the whole result as JSON: --json or --result-file PATH"])


def cmd_runs_show(args) -> None:
    from reflow.infra.store.records import before_training, eval_points, format_table, iteration_table, with_evals
    from reflow.infra.store.storage import ExperimentStore, StorageError

    try:
        store = ExperimentStore.open(args.storage, args.experiment, endpoint_url=args.endpoint_url)
    except (ValueError, StorageError) as e:  # a bad --experiment name, a --storage URL with credentials
        raise UsageError(str(e)) from e
    df = iteration_table(store)
    if df.empty:
        raise UsageError(f"no iteration records under {store.url('iterations')}; check --storage and "
                         f"--experiment (the run's storage.root and experiment)")
    points = eval_points(store)
    df = with_evals(df, points)
    if args.csv:
        print(df.to_csv(index=False), end="")
        return
    if before := before_training(points):
        print("before training (policy version 0): " + ", ".join(f"{k} pass@1 {v:.4f}" for k, v in before.items()))
    print(f"eval columns: pass@1 of the policy each iteration produced; times in seconds\n{format_table(df)}"
          if points else format_table(df))


def cmd_lineage(args) -> None:
    from reflow.infra.store import lineage

    try:
        nodes = lineage.walk(args.checkpoint, args.endpoint_url)
    except (ValueError, OSError, RuntimeError) as e:  # not a checkpoint URL, not committed, unreadable
        raise UsageError(f"{args.checkpoint}: {e}") from e
    print(json.dumps([vars(n) for n in nodes], indent=1) if args.json else lineage.format_chain(nodes))


def cmd_export_merged(args) -> None:
    from reflow.infra.store.export import export_merged
    from reflow.infra.store.storage import ExperimentStore

    try:
        like = ExperimentStore.open(args.checkpoint.rstrip("/").rpartition("/")[0], "export",
                                    endpoint_url=args.endpoint_url, retries=2)
        done = export_merged(args.checkpoint, args.out, like, base=args.base)
    except (ValueError, OSError, RuntimeError, KeyError, AttributeError) as e:  # no adapter, bad folder, mismatch
        raise UsageError(f"export-merged {args.checkpoint}: {e}") from e
    print(json.dumps(done, indent=2))


def _demo_policy(seed: int, digits: int, named: str, size: str = "tiny") -> Path:
    """Seed 0 uses the folder configs/demo.yaml names (`named`, where `reflow bootstrap` writes by
    default), so the README's deployment steps find the policy `make demo` built; other seeds get
    folders of their own. `size` "gpu": the GPU demo's policy, warmed up on the GPU."""
    from reflow.rl.demo_policy import SIZES, WARMUP, bootstrap

    out = Path(named) if seed == 0 else Path(f"{named}-d{digits}-s{seed}")
    if not (out / "config.json").is_file():
        print(f"reflow: bootstrapping the demo policy into {out} (once per seed)", file=sys.stderr)
        device = "cuda" if size == "gpu" else "cpu"
        bootstrap(out, seed=seed, digits=digits, device=device, **SIZES[size], **WARMUP[size])
    return out


def _stage_line(history: list[dict], loop_seconds: float | None = None) -> str:
    """Mean seconds per stage and generation/training throughput over the run's iterations. samples_per_s
    counts the training loop's wall time to its last iteration's end (`loop_seconds`, else the iterations'
    and the bookkeeping between them, `loop_between_s`): what a single-process trainer's samples/s counts."""
    def total(key: str) -> float:
        return sum(float(m.get(key, 0.0)) for m in history)

    n = max(len(history), 1)
    stages = " ".join(f"{k}={total('time_' + k) / n:.2f}s" for k in ("generate", "train", "push"))
    stages += f" between={total('loop_between_s') / n:.2f}s"
    # over the engines' own generation time: a generation run ahead is waited for by `generate` for less
    tokens_per_s = total("response_tokens") / max(total("generate_engine_s") or total("time_generate"), 1e-9)
    samples_per_s = total("samples") / max(loop_seconds or total("time_iteration") + total("loop_between_s"), 1e-9)
    return f"demo: per-iteration {stages} tokens_per_s={tokens_per_s:.0f} samples_per_s={samples_per_s:.1f}"


def _tools_demo(seed: int) -> list[str]:
    """`reflow demo --task tools`: the task's files and the tool-trace policy (once per seed), as overrides."""
    from reflow.rl.tool_demo import bootstrap_tools, write_tool_data

    data = write_tool_data(f".reflow/data/tools-s{seed}", seed)
    # "-v2": the warm-up recipe changed (a mix of direct answers and tool calls); a policy cached by the
    # first recipe (tool traces only) is flat and fragile and learns nothing at this config's settings.
    out = Path(f".reflow/models/tools-policy-v2-s{seed}")
    if not (out / "config.json").is_file():
        print(f"reflow: bootstrapping the tools demo policy into {out} (once per seed)", file=sys.stderr)
        bootstrap_tools(out, data, seed=seed)
    return [f"model.path={out}", f"data.path={data['train']}", f"data.eval_path={data['heldout']}"]


def _scratchpad_demo(seed: int, size: str) -> list[str]:
    """`reflow demo --task scratchpad`: the task's files and its policy (bootstrapped once per seed and size), as
    overrides."""
    from reflow.rl.scratchpad_demo import write_scratchpad_data

    out, folder = _scratchpad_policy(seed, size), _scratchpad_data(seed, size)
    if (out / "config.json").is_file():
        data = {k: str(folder / f"{k}.jsonl") for k in ("train", "heldout")}
        if not all(Path(f).is_file() for f in data.values()):  # the same files again: they are fixed by seed and size
            data = write_scratchpad_data(folder, seed, size)
    else:
        print(f"reflow: bootstrapping the scratchpad policy into {out} (once per seed)", file=sys.stderr)
        data = _scratchpad_bootstrap(seed, size, "cuda" if size == "gpu" else "cpu")["data"]
    return [f"model.path={out}", f"data.path={data['train']}", f"data.eval_path={data['heldout']}"]


def _demo_config(args) -> Path:
    if args.task == "scratchpad":
        return GPU_SCRATCHPAD_CONFIG if args.gpu else SCRATCHPAD_CONFIG
    return GPU_DEMO_CONFIG if args.gpu else TOOLS_DEMO_CONFIG if args.task == "tools" else DEMO_CONFIG


def cmd_demo(args) -> None:
    t0, started_at = time.perf_counter(), time.time()
    if args.task == "tools" and args.gpu:
        raise UsageError("reflow demo --task tools runs on CPU only; drop --gpu")
    if args.gpu and not _cuda():
        raise UsageError("reflow demo --gpu trains on a GPU, and torch sees none here: run `reflow demo` "
                         "(the CPU demo), or check CUDA_VISIBLE_DEVICES and that torch is a CUDA build")
    config = _demo_config(args)
    base = _config(str(config), [])
    # A fresh experiment per invocation, so running the demo twice trains twice (every run
    # keeps its own checkpoints and records); pass experiment=NAME --resume auto to continue one.
    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = [f"seed={args.seed}", f"data.seed={args.seed}", f"experiment={base.experiment}-s{args.seed}-{stamp}"]
    if args.task == "tools":
        overrides += _tools_demo(args.seed)
    elif args.task == "scratchpad":
        overrides += _scratchpad_demo(args.seed, "gpu" if args.gpu else "tiny")
    else:
        policy = _demo_policy(args.seed, base.data.digits, base.model.path, "gpu" if args.gpu else "tiny")
        overrides.append(f"model.path={policy}")
    if args.seed == 0 and not args.gpu and args.task == "addition":  # the files configs/demo-retrain.yaml names
        _demo_data(DEMO_DATA, 0, base.data.digits)
    cfg = _config(str(config), overrides + args.overrides + _resume_override(args))
    with _terminal(args, cfg):
        from reflow.flows.train import train  # after terminal(), as in cmd_train

        summary = train(cfg)
    if summary.get("already_complete"):
        _emit(args, summary, [f"demo: {summary['message']}"])
        return
    evals = summary["evals"]  # policy version -> {eval set: summary}; the demo's one set is `heldout`
    before, after = (next(iter(evals[v].values()))["pass@1"] for v in (min(evals), max(evals)))
    # eval.before_train=false (or a resumed run with no eval at its start): the first eval is the last one
    shown_before = f"{before:.3f}" if min(evals) < max(evals) else "n/a"
    # trained_s: from this command's start to its training loop's end (the final policy exists; its save and
    # the eval after it follow): the clock bench/gpu_machine/compare.sh gives TRL, whose run stops at its last step
    trained = f" trained_s={summary['loop_ended_at'] - started_at:.0f}" if summary.get("loop_ended_at") else ""
    _emit(args, summary, [_stage_line(summary["history"], summary.get("loop_seconds")),
                          f"demo: accuracy_before={shown_before} accuracy_after={after:.3f} "
                          f"iterations={summary['iterations']} seconds={time.perf_counter() - t0:.0f}{trained}",
                          f"demo: {_where(cfg)}"])


def cmd_ctl(args) -> None:
    """One request to the live run's control API (infra/ops/control.py); its answer printed."""
    import httpx

    from reflow.infra.ops import control

    try:
        r = control.request(args.experiment, args.action)
    except (control.NoLiveRun, ValueError) as e:  # ValueError: not an experiment name (infra/config/guards.py)
        raise UsageError(str(e)) from e
    except (OSError, httpx.HTTPError) as e:  # a server gone since the record was written, an unreadable token file
        raise UsageError(f"experiment {args.experiment!r}: its run's control API did not answer ({e})") from e
    if r.status_code != 200:
        raise UsageError(f"experiment {args.experiment!r}: {args.action} answered {r.status_code}: {r.text}")
    print(r.text.rstrip("\n") if args.action == "metrics" else json.dumps(r.json(), indent=2))


def cmd_cluster(args) -> None:
    from reflow.infra.cluster import ray_head as cluster

    if args.cluster_command == "up":
        info, started = cluster.up(args.state_dir, port=args.port, num_cpus=args.num_cpus, host=args.host,
                                   resources=_resources_arg(args.resources), fork_workers=args.fork_workers)
        print(f"reflow: Ray head {'started' if started else 'already running'} at {info.address} "
              f"(pid {info.pid}, {info.num_cpus} CPUs). Attach flows and workers with:")
        print(" ".join(f"export {k}={v};" for k, v in info.env().items()))
        print(f"reflow: token authentication on (token in {info.token_path}, readable by you only); "
              f"listening on {info.address.rsplit(':', 1)[0]} only")
        if info.fork_socket:
            print("reflow: workers start forked from a process that has imported torch, transformers and DeepSpeed "
                  "(--fork-workers off: as Ray starts them)")
    elif args.cluster_command == "status":
        st = cluster.status(args.state_dir)
        print(json.dumps(st, indent=2, default=str) if args.json else _status_text(st))
    else:
        killed = cluster.release_experiments(args.state_dir, args.experiment)
        print(f"reflow: released {len(killed)} actor(s)" + (f": {', '.join(killed)}" if killed else ""))
        if args.experiment is None:
            info = cluster.down(args.state_dir)
            print("reflow: Ray head stopped" if info else "reflow: no Ray head was running")


def _resources_arg(text: str | None) -> dict[str, float] | None:
    """`--resources '{"name": amount}'` as Ray's `ray start --resources` takes it."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--resources {text!r} is not JSON ({e}); e.g. --resources '{{\"reflow_engine_node\": 1}}'") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in value.values()):
        raise UsageError(f"--resources {text!r}: a JSON object of custom resource names and positive amounts, "
                         f"e.g. '{{\"reflow_engine_node\": 1}}'")
    return value


def _status_text(st: dict) -> str:
    if not st["up"]:
        return "reflow: no Ray head is running (start one with `reflow cluster up`)"
    if st.get("recorded", True):
        exports = " ".join(f"{k}={v}" for k, v in st["env"].items())
        lines = [f"Ray head {st['address']} (pid {st['pid']}, {st['num_cpus']} CPUs); export {exports}"]
    else:
        lines = [f"Ray cluster at {st['address']} (RAY_ADDRESS; not started by `reflow cluster up`)"]
    lines.append(f"{len(st['nodes'])} node(s):")
    lines += [f"  {n['node']}  {'alive' if n['alive'] else 'DEAD'}  {n['custom_resources'] or ''}".rstrip()
              for n in st["nodes"]]
    lines.append(f"{len(st['actors'])} reflow actor(s):")
    lines += ["  " + "  ".join(f"{k}={v}" for k, v in row.items()) for row in st["actors"]]
    return "\n".join(lines)


def _checkpoint_command(sub, name: str, fn, help_: str, description: str) -> argparse.ArgumentParser:
    """A subcommand that reads one checkpoint from storage (no Prefect, no Ray)."""
    p = sub.add_parser(name, help=help_, description=description)
    p.add_argument("checkpoint", help="checkpoint URL (…/<experiment>/checkpoints/iter_NNNNNN)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint override (credentials: AWS chain)")
    p.set_defaults(fn=fn)
    return p


def _flow_args(p: argparse.ArgumentParser, fn) -> None:
    """What every flow command (demo, train, evaluate) takes last: the terminal's mode, the result as JSON
    (it ends with a short summary on stdout otherwise), the config overrides; and what runs it."""
    p.add_argument("--verbose", "-v", action="store_true", help=VERBOSE_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--result-file", default=None, metavar="PATH", help=RESULT_FILE_HELP)
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p.set_defaults(fn=fn)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reflow",
        description="RL post-training of LLMs: each rollout iteration is a Prefect flow run driving "
                    "Ray actors (DeepSpeed trainers, SGLang-API rollout engines).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="bootstrap the tiny demo policy and train it with GRPO (no GPU needed)",
                       description="Build (once) a tiny warmed-up policy for 2-digit addition, train it with "
                                   "GRPO using configs/demo.yaml, and print held-out accuracy before and after.")
    d.add_argument("--seed", type=int, default=0, help="seed of the task, the policy and the run (default 0)")
    d.add_argument("--gpu", action="store_true",
                   help="the GPU demo instead: a ~113M policy warmed up on the GPU, 3-digit addition, "
                        "configs/gpu-demo.yaml (one GPU colocated; see bench/RESULTS.md for two)")
    d.add_argument("--task", choices=["addition", "tools", "scratchpad"], default="addition",
                   help="addition (default); tools: multi-turn 2-digit multiplication with a calculator "
                        "tool, configs/demo-tools.yaml; scratchpad: long multiplication worked out step by step "
                        "(long responses), configs/demo-scratchpad.yaml, with --gpu configs/gpu-scratchpad.yaml")
    d.add_argument("--resume", default=None, metavar="auto|never|URL", help=RESUME_HELP)
    _flow_args(d, cmd_demo)

    t = sub.add_parser("train", help="run the train flow for an experiment file",
                       description="Run the `train` Prefect flow in this process: one flow run per iteration. "
                                   "Ends with a short summary (iterations, the last reward and eval, where "
                                   "checkpoints and records are, wall time); --json or --result-file give the "
                                   "whole result as JSON.")
    t.add_argument("--config", "-c", required=True, help="experiment YAML (see configs/)")
    t.add_argument("--resume", default=None, metavar="auto|never|URL", help=RESUME_HELP)
    _flow_args(t, cmd_train)

    e = sub.add_parser("evaluate", help="eval-only: run the eval sets against a saved checkpoint",
                       description="Run the `evaluate` Prefect flow: rollout engines load a checkpoint's model "
                                   "(no trainers) and every set of the config's `eval.sets` is evaluated; results "
                                   "go to <experiment>/evals/iter_NNNNNN/<set>/. Ends with a short summary; "
                                   "--json or --result-file give the whole result as JSON.")
    e.add_argument("--config", "-c", required=True, help="experiment YAML (see configs/)")
    e.add_argument("--checkpoint", default="latest", metavar="latest|URL",
                   help="latest (default): the experiment's newest committed checkpoint; or a checkpoint URL "
                        "(…/checkpoints/iter_NNNNNN)")
    _flow_args(e, cmd_evaluate)

    r = sub.add_parser("runs", help="inspect experiments from storage alone (no Prefect, no Ray)")
    rsub = r.add_subparsers(dest="runs_command", required=True, metavar="SUBCOMMAND")
    rs = rsub.add_parser("show", help="print an experiment's per-iteration table",
                         description="Read iterations/*/metrics.json of an experiment and print one row per "
                                     "iteration (a readable summary, or every metric as CSV).")
    rs.add_argument("--storage", required=True, help="storage root (file:///path, a path, or s3://bucket/prefix)")
    rs.add_argument("--experiment", required=True, help="experiment name")
    rs.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint override (credentials: AWS chain)")
    rs.add_argument("--csv", action="store_true", help="print every metric as CSV")
    rs.set_defaults(fn=cmd_runs_show)

    lg = _checkpoint_command(sub, "lineage", cmd_lineage, "print a checkpoint's chain of ancestors back to the "
                             "initial model", "Read LINEAGE.json of a checkpoint and of each ancestor (parent, config, "
                             "code and data digests, flow runs, promoting retrain decisions); storage only.")
    lg.add_argument("--json", action="store_true", help="print the chain as JSON")
    x = _checkpoint_command(sub, "export-merged", cmd_export_merged, "merge a LoRA checkpoint's adapter into its "
                            "base: a plain HF folder", "Write base model + the checkpoint's adapter (adapter/) merged, "
                            "as the engines merge it, into a new folder that AutoModelForCausalLM.from_pretrained loads.")
    x.add_argument("out", help="new (or empty) local folder to write")
    x.add_argument("--base", default=None, help="base model folder or URL (default: the run's model.path, "
                                                "as the adapter records it)")

    b = sub.add_parser("bootstrap", help="build the demo policy: tiny Llama + char tokenizer, warmed up, HF format",
                       description="Build a tiny causal LM and tokenizer, warm it up on the synthetic addition "
                                   "task and save it as an HF checkpoint folder (config, safetensors, tokenizer).")
    b.add_argument("--task", choices=["addition", "scratchpad"], default="addition",
                   help="addition (default): the demo's sums; scratchpad: long multiplication worked out step by "
                        "step (reflow.rl.scratchpad_task), warmed up on worked traces")
    b.add_argument("--out", default=None,
                   help=f"output folder (default {ADDITION_POLICY}; scratchpad: .reflow/models/scratchpad-SIZE-sSEED, "
                        f"where `reflow demo --task scratchpad` looks)")
    b.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    b.add_argument("--digits", type=int, default=2, help="addition: digits per operand (default 2)")
    b.add_argument("--steps", type=int, default=None, help="warm-up optimizer steps at most (default: tuned value)")
    b.add_argument("--size", choices=["tiny", "gpu"], default="tiny",
                   help="model shape: tiny (~1M parameters, the CPU demo) or gpu (~113M, configs/gpu-demo.yaml)")
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the warm-up runs (default: a GPU when torch sees one)")
    b.add_argument("--lr", type=float, default=None, help="warm-up learning rate (default 1e-3)")
    b.add_argument("--batch", type=int, default=None, help="warm-up rows per step (default 64)")
    b.add_argument("--target-accuracy", type=float, default=None,
                   help="stop the warm-up once greedy train accuracy reaches this (default 0.4: partly competent, "
                        "so GRPO groups have mixed rewards)")
    b.add_argument("--data-out", default=None,
                   help=f"addition: also write the task's held-out split as a fixed eval file and a batch of new "
                        f"problems here, for configs/demo-retrain.yaml (default {DEMO_DATA}; '' skips them); "
                        f"scratchpad: the train and held-out files (default .reflow/data/scratchpad-SIZE-sSEED)")
    b.set_defaults(fn=cmd_bootstrap)

    ct = sub.add_parser("ctl", help="control a live train run: health, metrics, pause, resume, save, stop",
                        description="Talk to the control API of the experiment's live `train` run on this machine "
                                    "(its address and token file are recorded next to the experiment's lease). "
                                    "pause: no new iteration after the current one until resume; save: a checkpoint "
                                    "after the current iteration; stop: finish it, save, end the run (COMPLETED).")
    ct.add_argument("experiment", help="experiment name")
    ct.add_argument("action", choices=["health", "metrics", "pause", "resume", "save", "stop"])
    ct.set_defaults(fn=cmd_ctl)

    cl = sub.add_parser("cluster", help="a long-lived local Ray head whose actors later flow runs reuse",
                        description="Start, inspect or stop a Ray head for reflow (loopback only, token "
                                    "authentication, no dashboard). Flows "
                                    "attach through RAY_ADDRESS; each experiment's engines and trainers are then "
                                    "detached actors that the next flow run of the experiment reuses.")
    clsub = cl.add_subparsers(dest="cluster_command", required=True, metavar="SUBCOMMAND")
    for name, text in (("up", "start the head (no-op if it runs) and print the RAY_ADDRESS to export"),
                       ("status", "show the head and every reflow actor on it (weight version, pid)"),
                       ("down", "release reflow's actors, then stop the head (with --experiment: that "
                                "experiment's actors only, the head stays)")):
        cp = clsub.add_parser(name, help=text, description=text)
        cp.add_argument("--state-dir", default=None, help="where the head's record lives (default "
                        "$REFLOW_CLUSTER_DIR or .reflow/cluster)")
        if name == "up":
            cp.add_argument("--port", type=int, default=6390, help="GCS port (default %(default)s)")
            cp.add_argument("--num-cpus", type=int, default=None, help="logical CPUs (default max(4, cores))")
            cp.add_argument("--resources", default=None, metavar="JSON",
                            help="custom Ray resources of the head node, e.g. '{\"reflow_engine_node\": 1}' "
                                 "(rollout.node_resources / trainer.node_resources place actors by them; "
                                 "docs/scale-out.md)")
            cp.add_argument("--fork-workers", choices=("auto", "on", "off"), default="auto",
                            help="start this node's Ray workers by forking a process that has imported torch, "
                                 "transformers and DeepSpeed, so an actor skips those imports (flows attaching "
                                 "with cluster.fork_workers=off do not). auto (default): on where this machine has "
                                 "no NVIDIA GPU (not yet measured on GPUs)")
            cp.add_argument("--host", default="127.0.0.1",
                            help="address to listen on (default %(default)s: loopback only). Give this machine's "
                                 "address only for a multi-node cluster: Ray then listens on every interface, "
                                 "guarded by the token (copy the token file to the other nodes)")
        if name == "status":
            cp.add_argument("--json", action="store_true", help="print JSON")
        if name == "down":
            cp.add_argument("--experiment", default=None, help="release only this experiment's actors")
        cp.set_defaults(fn=cmd_cluster)

    c = sub.add_parser("config", help="validate a config (file + overrides) and print it resolved",
                       description="Validate an experiment file plus overrides and print the full resolved config.")
    c.add_argument("--config", "-c", default=None, help="experiment YAML (default: built-in defaults)")
    c.add_argument("--check", action="store_true",
                   help="also run the preflight `train` runs (no Ray, no Prefect): model config and tokenizer "
                        "load, data and eval files read with their columns, reward functions score a row, "
                        "storage writable")
    c.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    c.set_defaults(fn=cmd_config)
    leaves = [x for x in sub.choices.values() if x not in (r, cl)]  # a group's default would override its leaf's
    for command in [*leaves, *rsub.choices.values(), *clsub.choices.values()]:
        command.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return p


def _ray_env_for(args) -> None:
    """Before Ray is imported (it reads these at import): attaching to the head `reflow cluster up`
    recorded takes its token file and loopback switch, so `RAY_ADDRESS` alone is enough; a head
    from a plain `ray start` keeps its token in ~/.ray/auth_token."""
    from reflow.infra.cluster import ray_head

    address = os.environ.get("RAY_ADDRESS")
    if args.command != "cluster" and not address:
        return  # the flow starts a cluster of its own (infra/cluster/ray_connect.py closes it)
    head = ray_head.read_head(getattr(args, "state_dir", None))
    if head is not None and (args.command == "cluster" or address == head.address):
        for k, v in head.env().items():
            os.environ.setdefault(k, v)
    elif "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def main(argv: list[str] | None = None) -> None:
    # The checkpoint-signing key stays in this process's memory, out of the environment Prefect's temporary
    # server, Ray's processes and every other child would inherit (infra/store/signing.py).
    signing.hold_env_key()
    args = build_parser().parse_args(argv)
    _ray_env_for(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("reflow").setLevel(logging.INFO)
    if args.command not in FLOW_COMMANDS:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.fn(args)
    except _user_errors() as e:
        if getattr(args, "debug", False):
            raise
        print(f"reflow: {e}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except Exception as e:
        from reflow.rl.rewards import reward_failure

        # A reward that fails during the run (NaN on real responses, say) is the user's to fix, like a bad input:
        # its one line (the terminal left out the flow runs' tracebacks of it: infra/ops/console.py).
        if (failure := reward_failure(e)) is None or getattr(args, "debug", False):
            raise
        print(f"reflow: {failure}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
