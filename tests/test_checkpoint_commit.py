"""A save's commit: the staged directory renamed into place, the marker moved, older checkpoints
beyond checkpoint.keep_last removed, never the one just committed."""
from __future__ import annotations

from megadiff.checkpoint.format import iteration_dir, read_latest_iteration
from megadiff.checkpoint.training_checkpoint import _commit, _staging_dir


def _saved(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def _commit_staged(directory, iteration: int, keep_last: int) -> None:
    _staging_dir(directory, iteration).mkdir()
    _commit(directory, iteration, keep_last)


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
