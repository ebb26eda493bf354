"""weight_sync.disk_dir (mode=disk): reflow writes its versions into a subfolder it owns and deletes
only versions it wrote there; nothing else in the user's folder is touched (issue 13, point 2)."""
from __future__ import annotations

from pathlib import Path

import pytest

from reflow.engines.weights.push import PUSH_SUBDIR, publish_weights


def _write(marker: str):
    def write(out: Path) -> None:
        (out / "model.safetensors").write_text(marker)

    return write


def _user_folder(root: Path) -> dict[str, str]:
    """A folder a user might point disk_dir at by mistake: names that start with 'v' included."""
    files = {"videos/holiday.mp4": "film", "vault/keys.txt": "secret", "venv/bin/python": "#!", "notes/todo.md": "x",
             "v1/mine.txt": "the user's own v1", "v2": "a file named v2"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return files


def test_pushes_leave_everything_they_did_not_write(tmp_path):
    files = _user_folder(tmp_path)
    first = Path(publish_weights(_write("one"), str(tmp_path), "1").path)
    second = Path(publish_weights(_write("two"), f"file://{tmp_path}", "2").path)
    assert first.parent == second.parent == tmp_path / PUSH_SUBDIR
    assert not first.exists() and (second / "model.safetensors").read_text() == "two"  # its own old version went
    for rel, text in files.items():
        assert (tmp_path / rel).read_text() == text, f"{rel} was changed or removed"


def test_a_folder_reflow_did_not_write_is_never_overwritten(tmp_path):
    stranger = tmp_path / PUSH_SUBDIR / "v3"
    stranger.mkdir(parents=True)
    (stranger / "data.bin").write_text("not reflow's")
    with pytest.raises(FileExistsError, match="was not written by reflow"):
        publish_weights(_write("three"), str(tmp_path), "3")
    assert (stranger / "data.bin").read_text() == "not reflow's"
    publish_weights(_write("four"), str(tmp_path), "4")  # a later push cleans up only its own versions
    assert (stranger / "data.bin").read_text() == "not reflow's"
