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
the checkpoint URL (infra/store/promotion.py).

Trust (issue 51). Whoever can write the bucket can rewrite LINEAGE.json and fix MANIFEST.json and
COMMITTED up to match; only SIGNATURE (infra/store/checkpoint.py) is beyond them, and `reflow lineage`
runs where the key may not be. So the walk reads everything as untrusted JSON and:
  - reports for each checkpoint whether what it shows is authentic (`verified`): its SIGNATURE
    verifies with a key held here, for its own folder (signatures name experiment and step), or its
    manifest sha256 is the one a verified descendant recorded (LINEAGE.json is in the manifest, so
    the digest covers it). A deleted ancestor's summary is as trustworthy as the record it came from.
    Verifying is never required: without the key the chain still prints, marked not verified;
  - follows a parent URL only when it cannot be the bucket writer's choice of where to send
    requests: it lies inside the storage root of the checkpoint asked about (same scheme, bucket
    and prefix, then plain path segments: no `..`), which the reader already chose to read, or it was
    recorded by a verified checkpoint (a run holding the key resumed from it). Otherwise the chain
    stops there and says where the link leads; `reflow lineage <that URL>` goes on if the reader
    trusts it;
  - reads each checkpoint once (a parent already in the chain is a loop: the chain stops), and at
    most MAX_CHAIN of them; a parent record that is not {url, step, manifest_sha256} stops it too.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from reflow.infra.config.guards import segment_problem
from reflow.infra.store import checkpoint as ckpt
from reflow.infra.store import signing
from reflow.infra.store.storage import ExperimentStore, StorageAccess, StorageError, normalize_root

LINEAGE = "LINEAGE.json"
SUMMARY_KEYS = ("parent", "config_sha256", "code", "data", "initial_model", "flow_runs")
MAX_CHAIN = 10_000  # checkpoints one walk reads at most (real chains are far shorter)


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
    if hashlib.sha256(data).hexdigest() != files[LINEAGE].get("sha256"):
        raise ckpt.CheckpointInvalid(f"{ck.url}: {LINEAGE} does not match its sha256 in the manifest")
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ckpt.CheckpointInvalid(f"{ck.url}: {LINEAGE} is not a JSON object")
    return doc


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
    verified: bool = False  # what it shows is what a run holding the signing key saved (module docstring)
    signature: str = ""  # how `verified` was decided: the key, the descendant that vouches for it, or why not
    stop: str = ""  # on the last node: why the walk did not go on to its parent


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
        if not store.exists(rel) or not isinstance(d := store.read_json(rel), dict):
            continue
        if d.get("checkpoint") == url and d.get("promote"):
            found.append({"run": run, "reason": d.get("reason"), "metric": d.get("metric"),
                          "value": d.get("candidate"), "data_files": d.get("data_files", [])})
    return found


def storage_root(url: str) -> str:
    """Where a walk that starts at checkpoint `url` follows unverified parent links: the storage root of
    …/<root>/<experiment>/checkpoints/iter_N, else the folder that holds the checkpoint."""
    scheme, _, path = url.rstrip("/").partition("://") if "://" in url else ("", "", url.rstrip("/"))
    segs = path.split("/")
    keep = segs[:-3] if len(segs) >= 4 and segs[-2] == ckpt.ROOT and any(segs[:-3]) else segs[:-1]
    return (f"{scheme}://" if scheme else "") + "/".join(keep)


def within(url: str, root: str) -> bool:
    """`url` names something inside `root`: its prefix, then only plain path segments (no `..`, `.`,
    empty segment, query or escape that could lead elsewhere)."""
    if not url.startswith(root + "/"):
        return False
    return all(segment_problem(seg) is None for seg in url[len(root) + 1:].rstrip("/").split("/"))


def _keys(keys: signing.Keyring | None) -> tuple[signing.Keyring | None, str]:
    """The keys that verify signatures here (never used to sign), or None and why none could be loaded."""
    if keys is not None:
        return keys, ""
    try:
        return signing.keyring("lineage"), ""
    except signing.SigningKeyError as e:  # deliberate: the chain is still shown, as not verified
        return None, f"no checkpoint signing key could be loaded here ({e})"


def _clip(text: str, limit: int = 300) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[:limit] + "…"


def _why_unverified(url: str, reason: str) -> str:
    """The first sentence of a signature check's refusal, without the URL it starts with."""
    if reason.startswith(url):
        rest = reason[len(url):]
        reason = "it" + rest if rest.startswith(" ") else rest.lstrip(": ")
    head, dot, _ = reason.partition(". ")
    return _clip(head + dot.strip())


def _open(url: str, like: ExperimentStore, keys: signing.Keyring | None, no_keys: str) -> Node:
    """The live node at `url` (raises CheckpointInvalid / FileNotFoundError when it is gone or broken)."""
    ck = ckpt.from_url(url, like)
    seen = ckpt.examine(ck, keys)  # JSON only is read here: nothing is unpickled
    lineage = read_lineage(ck, seen.files)
    node = Node(ck.url, ck.step, seen.manifest_sha256, lineage or {})
    node.verified = seen.key_id is not None
    node.signature = (f"verified (key {seen.key_id})" if node.verified
                      else f"not verified: {_why_unverified(ck.url, no_keys or seen.unverified)}")
    if lineage is None:
        node.note = f"no {LINEAGE} (saved before lineage was recorded): its ancestry is unknown"
    node.promotions = promotions(experiment_of(ck), ck.url)
    return node


def _parent(record: dict) -> tuple[dict | None, str]:
    """(the parent link of a LINEAGE.json or summary, ""), (None, "") at the initial model, or (None, why)
    when it is not a link reflow writes: {url: str, step: int, manifest_sha256: str}."""
    link = record.get("parent")
    if link is None:
        return None, ""
    if (isinstance(link, dict) and isinstance(link.get("url"), str) and isinstance(link.get("step"), int)
            and isinstance(link.get("manifest_sha256"), str)):
        return link, ""
    return None, f"the parent record is not one reflow writes ({_clip(repr(link), 120)})"


def _ancestors(record: dict, default: list[dict]) -> list[dict]:
    if "ancestors" not in record:
        return default
    found = record["ancestors"]
    return [a if isinstance(a, dict) else {} for a in found] if isinstance(found, list) else []


def _not_followed(url: str, child: Node, root: str, seen: set[str], length: int) -> str:
    """Why the walk must not read the parent at `url` of `child` ("" when it may: module docstring)."""
    name = ckpt.name_of(child.step)
    if url.rstrip("/") in seen:
        return f"the parent of {name}, {url}, is already in this chain: a loop, which no save writes"
    if length >= MAX_CHAIN:
        return f"the chain is {MAX_CHAIN} checkpoints long, the most one walk reads"
    if child.verified or within(url, root):
        return ""
    return (f"the parent of {name}, {url}, is outside {root}, where this walk started, and {name} is not "
            f"verified (its signature line says why): whoever can write the bucket can put any URL in its "
            f"record, so it is not read. If you trust it, continue with `reflow lineage {url}`")


def chain(url: str, like: ExperimentStore, keys: signing.Keyring | None = None) -> list[Node]:
    """The checkpoint at `url`, then each ancestor back to the one trained from the initial model, as far
    as parent links may be followed (module docstring: Trust). An ancestor that is gone (retention) or
    changed is taken from the newest descendant's record (a verified one's, when there is one).
    `keys` (default: REFLOW_CHECKPOINT_KEY and this machine's key files) only verify."""
    keys, no_keys = _keys(keys)
    first = _open(url, like, keys, no_keys)
    root = storage_root(first.url)  # as from_url normalised it, like the URLs saves record
    nodes, seen = [first], {first.url.rstrip("/")}
    recorded, recorded_by = _ancestors(first.lineage, []), first
    while True:
        child = nodes[-1]
        parent, malformed = _parent(child.lineage)
        if parent is None:
            child.stop = malformed and f"{ckpt.name_of(child.step)}: {malformed}"
            break
        if why := _not_followed(parent["url"], child, root, seen, len(nodes)):
            child.stop = why
            break
        seen.add(parent["url"].rstrip("/"))
        summary = recorded.pop(0) if recorded else {}
        try:
            node = _open(parent["url"], like, keys, no_keys)
        # deliberate: a gone or broken ancestor is reported, and taken from its descendant's record
        except (ckpt.CheckpointInvalid, StorageError, OSError, KeyError, ValueError, TypeError) as e:
            node = Node(parent["url"], parent["step"], parent["manifest_sha256"],
                        {k: summary.get(k) for k in SUMMARY_KEYS}, live=False,
                        note=f"not readable now ({_clip(str(e), 200)}): as its descendant recorded it",
                        verified=recorded_by.verified,
                        signature=f"as recorded by {recorded_by.url}, "
                                  + ("verified" if recorded_by.verified else "not verified"))
        else:
            if node.manifest_sha256 != parent["manifest_sha256"]:
                node.note = (f"its manifest changed since {child.url} was saved from it (recorded "
                             f"{parent['manifest_sha256'][:12]}, now {(node.manifest_sha256 or '')[:12]})")
            elif child.verified and not node.verified:  # the verified record holds this manifest's sha256
                node.verified = True
                node.signature = (f"verified through {child.url}, which records its manifest sha256 "
                                  f"(its own signature: {node.signature})")
            if node.verified or not recorded_by.verified:
                recorded, recorded_by = _ancestors(node.lineage, recorded), node
        nodes.append(node)
    return nodes


def walk(url: str, endpoint_url: str | None = None) -> list[Node]:
    """`chain` of a checkpoint URL as the CLI gets it: a local path too, S3 with `endpoint_url`."""
    root = url if "://" in url else normalize_root(url)
    return chain(root, ExperimentStore.open(root.rstrip("/").rpartition("/")[0], "lineage",
                                            endpoint_url=endpoint_url, retries=2))


def format_chain(nodes: list[Node]) -> str:
    """`reflow lineage`'s text: one block per checkpoint, newest first, then the initial model (or why
    the walk stopped). Every value comes from storage, so each is checked for its type before use."""
    lines = []
    for n in nodes:
        lin = n.lineage
        lines.append(f"{ckpt.name_of(n.step)}  {n.url}" + ("" if n.live else "  [deleted or unreadable]"))
        lines.append(f"  manifest sha256 {n.manifest_sha256}")
        lines.append(f"  signature: {n.signature}")
        if lin:
            code = _obj(lin.get("code"))
            dirty = " (dirty)" if code.get("git_dirty") is True else ""
            lines.append(f"  config sha256 {lin.get('config_sha256')}; code reflow {code.get('version')} "
                         f"git {code.get('git_commit') or 'unknown'}{dirty}")
            lines += _data_lines(_obj(lin.get("data")))
            lines += _runs_line(_obj(lin.get("flow_runs")))
        lines += [f"  promoted by retrain run {p['run']}: {p['reason']}" for p in n.promotions]
        if n.note:
            lines.append(f"  note: {n.note}")
    last = nodes[-1]
    if last.stop:
        lines.append(f"not followed further: {last.stop}")
    elif last.lineage.get("initial_model") and last.lineage.get("parent") is None:
        lines.append(f"initial model  {last.lineage['initial_model']}")
    else:
        lines.append("older ancestry unknown (recorded before lineage existed)")
    return "\n".join(lines)


def _obj(value: object) -> dict:
    """`value` when it is a JSON object, else {} (LINEAGE.json is read as untrusted JSON)."""
    return value if isinstance(value, dict) else {}


def _runs_line(runs: dict) -> list[str]:
    """The train flow run and the last iteration's run (`--json` lists every iteration's)."""
    if not runs:
        return []
    its = sorted((int(i), r) for i, r in _obj(runs.get("iterations")).items()
                 if i.isascii() and i.isdigit() and len(i) <= ckpt.MAX_STEP_DIGITS)
    last = f"; iteration {its[-1][0]} {its[-1][1]}" + (f" (+{len(its) - 1} earlier)" if len(its) > 1 else "") if its else ""
    return [f"  flow runs: train {runs.get('train')}{last}"]


def _data_lines(data: dict) -> list[str]:
    cur = _obj(data.get("cursor"))
    out = [f"  data: task {data.get('task')}, seed {cur.get('seed')}, iterations {cur.get('from_iteration')}.."
           f"{cur.get('to_iteration')} (prompts {cur.get('prompts_from')}..{cur.get('prompts_to')})"]
    files = data.get("files")
    out += [f"    {f.get('url')} sha256 {f.get('sha256')} ({f.get('bytes')} bytes)"
            for f in (files if isinstance(files, list) else []) if isinstance(f, dict)]
    return out
