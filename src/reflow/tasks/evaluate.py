"""Evaluation: every eval set at one policy version -> per-sample parquet, summary JSON, a table artifact.

    launch_eval   one Ray task per set: its generation on the engines, then its scoring and records;
                  returns a `PendingEval` of ObjectRefs at once (not a task run: a few Ray submissions)
    record_eval   waits for a launched eval, logs it and adds the Prefect table artifact
    collect       records launched evals in launch order (all of them, or those already done)

Non-blocking evaluation (eval.blocking=false). The engines hold one weight version, so an eval of
policy version v must finish *generating* before version v+1 is pushed; scoring and writing need
no engine. `launch_eval` registers each set's task as an engine reader (its scoring, a few ms,
included), and every weight
push (tasks/train.py) and every colocated hand-over of the GPUs (tasks/colocate.py) first waits
for the readers (`wait_for_eval_generation`). So the eval of version v generates alongside the next
iteration's rollout (same weights) and while the trainer trains, and is gated only at the next
push. Nothing is snapshotted and no engine is set aside: the cost is that the next rollout shares
the engines with the eval. The train flow waits for every launched eval before it finishes.

Where: iterations/<v>/eval/<set>/{samples.parquet, summary.json} during training (v = policy
version = iterations trained), evals/iter_<step>/<set>/... for eval-only runs (flows/evaluate.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from reflow.engines import rollout_stages as ro
from reflow.engines.rollout_fns import BatchRequest, RolloutSettings
from reflow.infra.cluster.runtime import Runtime, get_eval_runtime, get_runtime
from reflow.infra.config.schema import RunConfig
from reflow.infra.inputs.eval_sets import EvalSet
from reflow.infra.store import checkpoint as ckpt
from reflow.tasks.report import artifact_key
from reflow.tasks.rollout import uses_adapter

# One set's eval in one Ray task, in the worker-side module (a task worker imports only that)
_eval_set = ray.remote(num_cpus=0)(ro.eval_set)


@dataclass
class PendingEval:
    """An eval launched at one policy version: one summary ObjectRef per set."""

    version: int
    out_dir: str
    generating: list[ray.ObjectRef]  # its runtime's `eval_generating`: the eval generations its engines still serve
    summaries: dict[str, ray.ObjectRef] = field(default_factory=dict)  # each set's one task: the engines' reader

    def done(self) -> bool:
        refs = list(self.summaries.values())
        return len(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) == len(refs)


def _launch_set(rt: Runtime, es: EvalSet, version: int, out_dir: str, timeout: float) -> ray.ObjectRef:
    sp = ro.sampling_params(es.temperature, es.top_p, es.top_k, es.max_new_tokens, [rt.eos_id],
                            es.skip_special_tokens, es.no_stop_trim)
    r = rt.cfg.rollout  # eval sets roll out with the run's rollout function too
    # An eval-only runtime (no trainers) serves a LoRA checkpoint merged (tasks/checkpoint.resolve_checkpoint): no adapter.
    adapter = rt.trainers is not None and uses_adapter(rt.cfg)
    settings = RolloutSettings(rt.generate_urls, sp, es.n, timeout, rt.api_key, r.generate_fn, r.max_concurrent_requests,
                               r.turn_limits(), adapter, es.seed)
    return _eval_set.remote(settings, BatchRequest(es.prompts, version), es.name, es.reward_fn, es.correct_threshold, es.ks, es.n,
                            [p.index for p in es.prompts], rt.store, out_dir, rt.cfg.reward.fn_timeout_s)


def launch(rt: Runtime, version: int, out_dir: str) -> PendingEval:
    """Start every eval set of `rt` against the weights its engines hold now (policy `version`)."""
    pending = PendingEval(version, out_dir, rt.eval_generating)
    for es in rt.eval_sets:
        pending.summaries[es.name] = _launch_set(rt, es, version, out_dir, rt.cfg.rollout.request_timeout_s)
    rt.eval_generating.extend(pending.summaries.values())  # readers until scored too
    return pending


def wait_for_eval_generation(rt: Runtime) -> float:
    """Block until the runtime's engines have finished every eval generation launched on them (call
    before changing or releasing their weights); returns the seconds waited. Failures are not raised
    here: they surface when the eval is recorded."""
    refs, rt.eval_generating[:] = list(rt.eval_generating), []
    t0 = time.perf_counter()
    if refs:
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
    return time.perf_counter() - t0


def launch_eval(cfg: RunConfig, version: int) -> PendingEval:
    """In-training eval of policy `version`, recorded under iterations/<version>/eval/. A plain call (a few
    Ray submissions): the eval's task run in the UI is `record-eval`, with its results."""
    rt = get_runtime(cfg)
    return launch(rt, version, f"{rt.store.iteration_dir(version)}/eval")


@task(name="launch-checkpoint-eval", cache_policy=NO_CACHE)
def launch_checkpoint_eval(cfg: RunConfig, step: int) -> PendingEval:
    """Eval-only: engines serving `cfg.model.path` (checkpoint iter_<step>'s model/), recorded under evals/iter_<step>/."""
    return launch(get_eval_runtime(cfg), step, f"evals/{ckpt.name_of(step)}")


@task(name="record-eval", cache_policy=NO_CACHE)
def record_eval(cfg: RunConfig, pending: PendingEval, where: str = "") -> dict[str, dict]:
    """Wait for one launched eval; log it and add its table artifact. Returns {set: summary}."""
    names = list(pending.summaries)
    results = dict(zip(names, ray.get([pending.summaries[n] for n in names])))
    done = set(pending.summaries.values())  # done generating too: stop holding its batches
    pending.generating[:] = [r for r in pending.generating if r not in done]
    log = get_run_logger()
    for name, s in results.items():
        passes = " ".join(f"{k} {v:.3f}" for k, v in s.items() if k.startswith("pass@"))
        log.info("eval %s @ policy version %d: %s reward %.3f len %.1f (%d prompts x %d)", name, pending.version,
                 passes, s["reward_mean"], s["response_len_mean"], s["prompts"], s["samples"] // max(s["prompts"], 1))
    rows = [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in s.items()} for s in results.values()]
    create_table_artifact(key=artifact_key(cfg.experiment, "eval"), table=rows,
                          description=f"{cfg.experiment}{where}: eval at policy version {pending.version} "
                                      f"(records under {pending.out_dir})")
    return results


def collect(cfg: RunConfig, pending: list[PendingEval], wait: bool) -> dict[int, dict[str, dict]]:
    """Record launched evals in launch order, popping them from `pending`: all of them (`wait`), or
    the leading ones already finished. Returns {policy version: {set: summary}}."""
    out = {}
    while pending and (wait or pending[0].done()):
        p = pending.pop(0)
        out[p.version] = record_eval(cfg, p)
    return out

