"""Layering: pure math stays pure, and imports point down only (flows > tasks > infra > engines > rl)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["flows", "tasks", "infra", "engines", "rl"]
HEAVY = {"ray", "prefect", "deepspeed"}


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


@pytest.mark.parametrize("layer", ORDER)
def test_imports_point_down(layer):
    above = set(ORDER[: ORDER.index(layer)])
    for f in (ROOT / layer).glob("*.py"):
        bad = _imports(f) & above
        assert not bad, f"{f.relative_to(ROOT)} imports from a higher layer: {sorted(bad)}"


def test_rl_imports_no_ray_prefect_deepspeed():
    for f in (ROOT / "rl").glob("*.py"):
        bad = _imports(f) & HEAVY
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}: rl/ must stay pure"
