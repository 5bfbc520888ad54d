"""A save's commit: the staged directory renamed into place, the marker moved, older checkpoints
beyond checkpoint.keep_last removed, never the one just committed; and the checkpoint a rerun finds."""
from __future__ import annotations

import pytest

from megadiff.checkpoint.format import (
    LATEST_FILE, CheckpointError, iteration_dir, latest_checkpoint, read_latest_iteration, resolve_checkpoint_dir,
)
from megadiff.checkpoint.training_checkpoint import _staging_dir
from megadiff.files import commit_iteration


def _saved(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def _commit_staged(directory, iteration: int, keep_last: int) -> None:
    _staging_dir(directory, iteration).mkdir()
    commit_iteration(directory, iteration, LATEST_FILE, f"{iteration}\n", keep_last)


def test_keep_last_removes_the_oldest(tmp_path):
    for iteration in (100, 200, 300):
        _commit_staged(tmp_path, iteration, keep_last=2)
    assert _saved(tmp_path) == ["iter_0000200", "iter_0000300"] and read_latest_iteration(tmp_path) == 300


def test_keep_last_counts_no_checkpoint_after_the_committed_one(tmp_path):
    """A run restarted from an earlier marker (rolled back to 900 past a bad 1000) saves 950: the
    newer 1000 left behind must not push 950 itself out."""
    for iteration in (900, 1000):
        iteration_dir(tmp_path, iteration).mkdir()
    _commit_staged(tmp_path, 950, keep_last=1)
    assert read_latest_iteration(tmp_path) == 950 and iteration_dir(tmp_path, 950).is_dir()
    assert _saved(tmp_path) == ["iter_0000950", "iter_0001000"]


def _whole(directory, iteration: int) -> None:
    """A committed checkpoint as latest_checkpoint sees one: named, with its metadata."""
    iteration_dir(directory, iteration).mkdir()
    (iteration_dir(directory, iteration) / "metadata.json").write_text("{}")


def test_checkpoints_without_their_marker_resume_from_the_newest_whole_one(tmp_path):
    """A crash between a first commit's rename and its marker, or checkpoints copied without it: starting
    afresh there wrote over the run's checkpoints and metrics."""
    assert latest_checkpoint(tmp_path) is None
    for iteration in (3, 6):
        _whole(tmp_path, iteration)
    iteration_dir(tmp_path, 9).mkdir()  # named but empty: not a checkpoint
    _staging_dir(tmp_path, 12).mkdir()
    assert latest_checkpoint(tmp_path) == iteration_dir(tmp_path, 6)


def test_a_marker_naming_a_removed_checkpoint_is_refused_with_those_left(tmp_path):
    for iteration in (3, 6):
        _whole(tmp_path, iteration)
    (tmp_path / LATEST_FILE).write_text("9\n")
    with pytest.raises(CheckpointError, match=r"names iteration 9, but .*iter_0000009 is missing: write the "
                                              r"iteration to resume from \(3, 6\) into it"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="names iteration 9"):
        resolve_checkpoint_dir(tmp_path)
