"""Checkpoint lineage: where each checkpoint came from, and the walk back to the initial model.

Each checkpoint holds LINEAGE.json, listed in its signed manifest like every other file:
    parent          {url, step, manifest_sha256} of the checkpoint its weights continued, or null
                    when they started from `initial_model` (the run's model.path)
    config_sha256   sha256 of the checkpoint's config.yaml (the resolved run config)
    code            reflow's package version, and the git commit + dirty flag of its source tree
                    when it runs from a git checkout
    data            the training data: task, files (url, sha256, bytes) and the cursor range of
                    iterations / prompts this checkpoint consumed since its parent
    flow_runs       the Prefect `train` flow run that saved it and the `iteration` flow runs it holds
    ancestors       the summaries of every older ancestor, parent first: retention deletes old
                    checkpoints, and the chain must still reach the initial model
The retrain decision that promoted a checkpoint is made after it is committed (and signed), so it
is not inside it: `chain` finds it in the experiment's retrain/runs/*/decision.json, which names
the checkpoint URL (infra/promotion.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from reflow.infra import checkpoint as ckpt
from reflow.infra.storage import ExperimentStore, StorageAccess, normalize_root

LINEAGE = "LINEAGE.json"
SUMMARY_KEYS = ("parent", "config_sha256", "code", "data", "initial_model", "flow_runs")


def code_version() -> dict[str, object]:
    """reflow's version, and git commit + dirty flag of the source tree it runs from (None outside git)."""
    try:
        version = metadata.version("reflow")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = None
    root = Path(__file__).resolve().parents[1]
    commit, dirty = _git(root, "rev-parse", "HEAD"), None
    if commit is not None:
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
    return {"package": "reflow", "version": version, "git_commit": commit, "git_dirty": dirty}


def _git(root: Path, *args: str) -> str | None:
    """git's output in `root`, or None where there is no git or no repository (an installed wheel)."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # deliberate: the code version is then unknown, not an error
        return None
    return out.stdout.strip() if out.returncode == 0 else None


_digests: dict[tuple[str, int], str] = {}  # (url, bytes) -> sha256: a data file is hashed once per process


def file_digest(url: str, access: StorageAccess) -> dict[str, object]:
    """{url, sha256, bytes} of a data file (hashed once per process while its size is unchanged)."""
    size = access.size(url)
    if (url, size) not in _digests:
        _digests[(url, size)] = hashlib.sha256(access.read_bytes(url)).hexdigest()
    return {"url": url, "sha256": _digests[(url, size)], "bytes": size}


def data_record(task: str, files: list[dict], seed: int, from_iteration: int, to_iteration: int,
                prompts_per_iteration: int) -> dict[str, object]:
    """What a checkpoint trained on since its parent: iterations [from, to) of the prompt cursor."""
    return {"task": task, "files": files,
            "cursor": {"seed": seed, "from_iteration": from_iteration, "to_iteration": to_iteration,
                       "prompts_from": from_iteration * prompts_per_iteration,
                       "prompts_to": to_iteration * prompts_per_iteration}}


@dataclass(frozen=True)
class Parent:
    """The checkpoint a run's trainer weights continue: what the next save names as its parent."""

    url: str
    step: int
    manifest_sha256: str
    lineage: dict | None  # its LINEAGE.json (None: saved before lineage existed)

    def summary(self) -> dict[str, object]:
        own = {k: self.lineage.get(k) for k in SUMMARY_KEYS} if self.lineage else {"lineage": "not recorded"}
        return {"url": self.url, "step": self.step, "manifest_sha256": self.manifest_sha256, **own}


def record(parent: Parent | None, initial_model: str, config_yaml: str, data: dict,
           flow_runs: dict[str, object]) -> dict[str, object]:
    """LINEAGE.json of a checkpoint about to be committed."""
    ancestors = [] if parent is None else [parent.summary(), *(parent.lineage or {}).get("ancestors", [])]
    return {"version": 1,
            "parent": None if parent is None else {"url": parent.url, "step": parent.step,
                                                   "manifest_sha256": parent.manifest_sha256},
            "initial_model": initial_model, "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest(),
            "code": code_version(), "data": data, "flow_runs": flow_runs, "ancestors": ancestors}


def manifest_sha256(ck: ckpt.Checkpoint) -> str:
    """The digest its COMMITTED marker holds (`ckpt.check` has compared it with MANIFEST.json)."""
    return ck.store.read_text(ck.rel(ckpt.MARKER)).strip()


def read_lineage(ck: ckpt.Checkpoint, files: dict[str, dict]) -> dict | None:
    """LINEAGE.json checked against the manifest's sha256; None for a checkpoint saved without one."""
    if LINEAGE not in files:
        return None
    data = ck.store.read_bytes(ck.rel(LINEAGE))
    if hashlib.sha256(data).hexdigest() != files[LINEAGE]["sha256"]:
        raise ckpt.CheckpointInvalid(f"{ck.url}: {LINEAGE} does not match its sha256 in the manifest")
    return json.loads(data)


def parent_of(ck: ckpt.Checkpoint, files: dict[str, dict]) -> Parent:
    return Parent(ck.url, ck.step, manifest_sha256(ck), read_lineage(ck, files))


# ---------------------------------------------------------------- the walk


@dataclass
class Node:
    """One ancestor: read from its own LINEAGE.json (`live`), or from a descendant's record of it."""

    url: str
    step: int
    manifest_sha256: str | None
    lineage: dict = field(default_factory=dict)  # the SUMMARY_KEYS at least
    live: bool = True
    note: str = ""  # why the stored copy could not be used, or that its manifest changed
    promotions: list[dict] = field(default_factory=list)


def experiment_of(ck: ckpt.Checkpoint) -> ExperimentStore | None:
    """The experiment store holding a checkpoint opened by URL (<root>/<experiment>/checkpoints/iter_N)."""
    exp_url, _, folder = ck.store.root.rpartition("/")
    root, _, name = exp_url.rpartition("/")
    if folder != ckpt.ROOT or not root or not name:
        return None
    return dataclasses.replace(ck.store, root=normalize_root(root), experiment=name)


def promotions(store: ExperimentStore | None, url: str) -> list[dict]:
    """The retrain decisions (retrain/runs/*/decision.json) that promoted the checkpoint at `url`."""
    if store is None:
        return []
    found = []
    for run in sorted(store.listdir("retrain/runs")):
        rel = f"retrain/runs/{run}/decision.json"
        if store.exists(rel) and (d := store.read_json(rel)).get("checkpoint") == url and d.get("promote"):
            found.append({"run": run, "reason": d.get("reason"), "metric": d.get("metric"),
                          "value": d.get("candidate"), "data_files": d.get("data_files", [])})
    return found


def _open(url: str, like: ExperimentStore) -> Node:
    """The live node at `url` (raises CheckpointInvalid / FileNotFoundError when it is gone or broken)."""
    ck = ckpt.from_url(url, like)
    files = ckpt.check(ck, signature=False)  # JSON only is read here: nothing is unpickled
    lineage = read_lineage(ck, files)
    node = Node(ck.url, ck.step, manifest_sha256(ck), lineage or {})
    if lineage is None:
        node.note = f"no {LINEAGE} (saved before lineage was recorded): its ancestry is unknown"
    node.promotions = promotions(experiment_of(ck), ck.url)
    return node


def chain(url: str, like: ExperimentStore) -> list[Node]:
    """The checkpoint at `url`, then each ancestor back to the one trained from the initial model.
    An ancestor that is gone (retention) or changed is taken from the newest descendant's record."""
    nodes = [_open(url, like)]
    recorded = list(nodes[0].lineage.get("ancestors", []))
    while (parent := nodes[-1].lineage.get("parent")) is not None:
        summary = recorded.pop(0) if recorded else {}
        try:
            node = _open(parent["url"], like)
        except (ckpt.CheckpointInvalid, FileNotFoundError, KeyError, ValueError) as e:  # deliberate: reported
            node = Node(parent["url"], parent["step"], parent["manifest_sha256"],
                        {k: summary.get(k) for k in SUMMARY_KEYS}, live=False,
                        note=f"not readable now ({str(e).splitlines()[0][:200]}): as its descendant recorded it")
        else:
            if node.manifest_sha256 != parent["manifest_sha256"]:
                node.note = (f"its manifest changed since {nodes[-1].url} was saved from it (recorded "
                             f"{parent['manifest_sha256'][:12]}, now {(node.manifest_sha256 or '')[:12]})")
            recorded = list(node.lineage.get("ancestors", recorded))
        nodes.append(node)
    return nodes


def walk(url: str, endpoint_url: str | None = None) -> list[Node]:
    """`chain` of a checkpoint URL as the CLI gets it: a local path too, S3 with `endpoint_url`."""
    root = url if "://" in url else normalize_root(url)
    return chain(root, ExperimentStore.open(root.rstrip("/").rpartition("/")[0], "lineage",
                                            endpoint_url=endpoint_url, retries=2))


def format_chain(nodes: list[Node]) -> str:
    """`reflow lineage`'s text: one block per checkpoint, newest first, then the initial model."""
    lines = []
    for n in nodes:
        lin = n.lineage
        lines.append(f"{ckpt.name_of(n.step)}  {n.url}" + ("" if n.live else "  [deleted or unreadable]"))
        lines.append(f"  manifest sha256 {n.manifest_sha256}")
        if lin:
            code = lin.get("code") or {}
            dirty = {True: " (dirty)", False: "", None: ""}[code.get("git_dirty")]
            lines.append(f"  config sha256 {lin.get('config_sha256')}; code reflow {code.get('version')} "
                         f"git {code.get('git_commit') or 'unknown'}{dirty}")
            lines += _data_lines(lin.get("data") or {})
            lines += _runs_line(lin.get("flow_runs") or {})
        lines += [f"  promoted by retrain run {p['run']}: {p['reason']}" for p in n.promotions]
        if n.note:
            lines.append(f"  note: {n.note}")
    last = nodes[-1].lineage
    if last.get("initial_model") and last.get("parent") is None:
        lines.append(f"initial model  {last['initial_model']}")
    else:
        lines.append("older ancestry unknown (recorded before lineage existed)")
    return "\n".join(lines)


def _runs_line(runs: dict) -> list[str]:
    """The train flow run and the last iteration's run (`--json` lists every iteration's)."""
    if not runs:
        return []
    its = sorted((int(i), r) for i, r in (runs.get("iterations") or {}).items())
    last = f"; iteration {its[-1][0]} {its[-1][1]}" + (f" (+{len(its) - 1} earlier)" if len(its) > 1 else "") if its else ""
    return [f"  flow runs: train {runs.get('train')}{last}"]


def _data_lines(data: dict) -> list[str]:
    cur = data.get("cursor") or {}
    out = [f"  data: task {data.get('task')}, seed {cur.get('seed')}, iterations {cur.get('from_iteration')}.."
           f"{cur.get('to_iteration')} (prompts {cur.get('prompts_from')}..{cur.get('prompts_to')})"]
    out += [f"    {f['url']} sha256 {f['sha256']} ({f['bytes']} bytes)" for f in data.get("files") or []]
    return out
