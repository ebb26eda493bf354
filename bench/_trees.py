"""Another commit's tree, importable as the `reflow` package for a same-run baseline (bench/iteration_overhead.py
--baseline, bench/rollout_generate.py --baseline). No side effects on import (bench/_common.py puts the repo root
first on sys.path, which on the GPU machine would shadow the installed package)."""
from __future__ import annotations

import tempfile
from pathlib import Path


def importable(tree: Path) -> Path:
    """A folder whose `reflow` package is `tree`'s, so a tree of another commit (e.g. `git archive <commit> | tar -x
    -C tree`) imports without being installed: put it first on sys.path and PYTHONPATH. A src-layout tree is its
    src/; an older tree (layers at its top, mapped by its pyproject.toml) gets a shim package whose path lists
    them. The tree itself is not touched."""
    if (tree / "src" / "reflow" / "__init__.py").is_file():
        return tree / "src"
    d = Path(tempfile.mkdtemp(prefix="reflow-shim-")) / "reflow"
    d.mkdir()
    (d / "__init__.py").write_text(f"__path__ = [{str(tree)!r}]\n")
    return d.parent
