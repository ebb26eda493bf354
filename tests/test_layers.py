"""Layering: pure math stays pure, and imports point down only (flows > tasks > infra > engines > rl),
across every module of every layer, subpackages included."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "reflow"
ORDER = ["flows", "tasks", "infra", "engines", "rl"]
HEAVY = {"ray", "prefect", "deepspeed"}


def _imports(path: Path) -> set[str]:
    """Top-level names imported by `path`; `reflow.<layer>...` counts as `<layer>`."""
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            mods.add(parts[1] if parts[0] == "reflow" and len(parts) > 1 else parts[0])
    return mods


def _modules(layer: str) -> list[Path]:
    files = sorted((PKG / layer).rglob("*.py"))
    assert files, f"no modules under {layer}/"
    return files


@pytest.mark.parametrize("layer", ORDER)
def test_imports_point_down(layer):
    above = set(ORDER[: ORDER.index(layer)])
    for f in _modules(layer):
        bad = _imports(f) & above
        assert not bad, f"{f.relative_to(ROOT)} imports from a higher layer: {sorted(bad)}"


# Inside a layer, its concerns point down too: infra's operator surface (ops) uses the Ray cluster
# (cluster), which uses inputs and the experiment store, which use the config; the engines' processes
# (train, embedded) use the weight transports, which use SGLang's wire contract. Peers of one rank
# (train and embedded) never import each other.
SUBLAYERS = {"infra": [["ops"], ["cluster"], ["inputs"], ["store"], ["config"]],
             "engines": [["train", "embedded"], ["weights"], ["sglang"]]}


def _subpackage(name: str, layer: str) -> str | None:
    parts = name.split(".")
    return parts[2] if parts[:2] == ["reflow", layer] and len(parts) > 2 else None


@pytest.mark.parametrize("layer", sorted(SUBLAYERS))
def test_concerns_inside_a_layer_point_down(layer):
    levels = SUBLAYERS[layer]
    rank = {sub: i for i, subs in enumerate(levels) for sub in subs}
    assert {p.name for p in (PKG / layer).iterdir() if p.is_dir() and p.name != "__pycache__"} == set(rank)
    bad = []
    for sub in rank:
        for f in sorted((PKG / layer / sub).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                for other in filter(None, (_subpackage(n, layer) for n in names)):
                    if other in rank and other != sub and rank[other] <= rank[sub]:
                        bad.append(f"{f.relative_to(ROOT)} imports reflow.{layer}.{other}")
    assert not bad, "imports that point up or sideways inside a layer:\n" + "\n".join(bad)


def test_rl_imports_no_ray_prefect_deepspeed():
    for f in _modules("rl"):
        bad = _imports(f) & HEAVY
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}: rl/ must stay pure"


def test_imports_use_the_reflow_namespace():
    """Installed, the layers exist only as reflow.<layer>: a bare `import engines...` works from a
    checkout and breaks in a wheel."""
    files = [f for layer in ORDER for f in _modules(layer)]
    for f in [*files, *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "bench").glob("*.py"))]:
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            bare = [n for n in names if n.split(".")[0] in ORDER]
            assert not bare, f"{f.relative_to(ROOT)} imports {bare}: use reflow.{bare[0]}"


def test_no_algorithm_name_checks_outside_rl_algorithms():
    """Algorithm-specific behaviour is asked of the spec (`cfg.algorithm.spec`), never decided by
    comparing `algorithm.type` (or any value) to an algorithm's name outside rl/algorithms/."""
    import re

    from reflow.rl.algorithms import SPECS

    names = "|".join(SPECS)
    patterns = [re.compile(r"algorithm\.type\s*(==|!=|in\b|not\s+in\b)"),
                re.compile(rf"""(==|!=)\s*["']({names})["']"""),
                re.compile(rf"""["']({names})["']\s*(==|!=)"""),
                re.compile(rf"""\bin\s*[(\[{{]\s*["']({names})["']""")]
    own = PKG / "rl" / "algorithms"
    hits = []
    for f in [p for layer in ORDER for p in _modules(layer) if own not in p.parents]:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if any(p.search(line) for p in patterns):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "algorithm name checks outside rl/algorithms/ (use the spec):\n" + "\n".join(hits)


# Module-level mappings in flows/ and tasks/ that are no run's state: caches keyed by content or settings.
PROCESS_CACHES = {"tasks/checkpoint.py:_MERGED",  # manifest digest -> this process's merged LoRA copy
                  "tasks/report.py:_TLS"}  # TLS settings -> the SSL context of this process's API clients


def test_no_run_state_in_module_globals_of_flows_and_tasks():
    """A run's driver state lives on its session (flows/session.py, tasks/state.py), never in a module-level
    dict keyed by experiment, which outlives the run and is shared by every run in the process."""
    found = []
    for layer in ("flows", "tasks"):
        for f in _modules(layer):
            for node in ast.parse(f.read_text()).body:
                target, value = ((node.targets[0], node.value) if isinstance(node, ast.Assign) else
                                 (node.target, node.value) if isinstance(node, ast.AnnAssign) else (None, None))
                if not isinstance(target, ast.Name) or value is None:
                    continue
                mapping = isinstance(value, (ast.Dict, ast.DictComp)) or (
                    isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id in {"dict", "defaultdict", "OrderedDict", "WeakValueDictionary"})
                if mapping and f"{f.relative_to(PKG)}:{target.id}" not in PROCESS_CACHES:
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno} {target.id}")
    assert not found, "module-level mappings in flows/ and tasks/ (put run state on the session):\n" + "\n".join(found)
