"""A save's commit: the staged directory renamed into place, the marker moved, older checkpoints
beyond checkpoint.keep_last removed, never the one just committed; and the checkpoint a rerun finds."""
from __future__ import annotations

from pathlib import Path

import pytest

from megadiff.checkpoint.format import (
    LATEST_FILE, CheckpointError, iteration_dir, latest_checkpoint, model_keys, read_latest_iteration,
    resolve_checkpoint_dir,
)
from megadiff.checkpoint.training_checkpoint import _staging_dir
from megadiff.files import commit_iteration


def _saved(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def _commit_staged(directory, iteration: int, keep_last: int, kept_before: int | None = None) -> None:
    _staging_dir(directory, iteration).mkdir()
    commit_iteration(directory, iteration, LATEST_FILE, f"{iteration}\n", keep_last, kept_before)


def test_keep_last_removes_the_oldest(tmp_path):
    for iteration in (100, 200, 300):
        _commit_staged(tmp_path, iteration, keep_last=2)
    assert _saved(tmp_path) == ["iter_0000200", "iter_0000300"] and read_latest_iteration(tmp_path) == 300


def test_keep_last_keeps_the_last_checkpoint_before_the_streak_of_skips_the_run_is_in(tmp_path):
    """Saves 100..500, a streak of skipped steps from 250 (saves 300..500 repeat 200's weights): keep_last=2 keeps
    the last two and 200; once the run updates again (no streak), retention is keep_last's alone."""
    streak_from = {100: None, 200: None, 300: 250, 400: 250, 500: 250, 600: None}
    for iteration, since in streak_from.items():
        _commit_staged(tmp_path, iteration, keep_last=2, kept_before=since)
        saved = sorted(streak_from)[:sorted(streak_from).index(iteration) + 1]
        expected = set(saved[-2:]) | ({max(i for i in saved if i < since)} if since else set())
        assert _saved(tmp_path) == [iteration_dir(tmp_path, i).name for i in sorted(expected)], iteration


def test_keep_last_leaves_a_checkpoint_being_read_until_a_later_commit(tmp_path):
    """generate, evaluate or to-hf reading a run's latest checkpoint while the run commits newer ones: the
    checkpoint they read was removed under them (megatron's 'does not exist', from inside its load)."""
    from megadiff.files import reading

    _commit_staged(tmp_path, 100, keep_last=1)
    with reading(iteration_dir(tmp_path, 100)):
        _commit_staged(tmp_path, 200, keep_last=1)
        assert _saved(tmp_path) == ["iter_0000100", "iter_0000200"]
    (tmp_path / "iter_0000050.removing").mkdir()  # a removal killed part way
    _commit_staged(tmp_path, 300, keep_last=1)
    assert _saved(tmp_path) == ["iter_0000300"]


def test_a_checkpoint_is_out_of_its_name_before_its_files_go(tmp_path, monkeypatch):
    """Removed in place, rmtree could take its readers' lock file before the rest, and a reader arriving then
    lock a new one there and read files as they went."""
    import shutil

    from megadiff import files

    seen, remove = [], shutil.rmtree

    def removing(path, **options):
        seen.append((Path(path).name, iteration_dir(tmp_path, 100).exists()))
        remove(path, **options)
    _commit_staged(tmp_path, 100, keep_last=1)
    monkeypatch.setattr(files.shutil, "rmtree", removing)
    _commit_staged(tmp_path, 200, keep_last=1)
    assert seen == [("iter_0000100.removing", False)] and _saved(tmp_path) == ["iter_0000200"]


def test_a_filesystem_without_locks_still_takes_turns_without_them(tmp_path, monkeypatch):
    """Lustre without `-o flock` (ENOSYS), NFS without lockd (ENOLCK): the work goes on, unlocked."""
    import errno
    import fcntl

    from megadiff.files import exclusive_lock

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with exclusive_lock(tmp_path / "x.lock"):
        done = True
    assert done
    _commit_staged(tmp_path, 100, keep_last=1)
    _commit_staged(tmp_path, 200, keep_last=1)
    assert _saved(tmp_path) == ["iter_0000200"]


def test_a_checkpoint_removed_before_it_is_held_is_read_at_the_run_s_newer_one(tmp_path, monkeypatch):
    import megadiff.checkpoint.format as checkpoint_format

    removed, committed = tmp_path / "iter_0000100", tmp_path / "iter_0000200"
    committed.mkdir()
    (committed / "metadata.json").write_text("{}")
    resolved = iter([removed, committed])
    monkeypatch.setattr(checkpoint_format, "resolve_checkpoint_dir", lambda path: next(resolved))
    with checkpoint_format.reading_checkpoint(tmp_path) as checkpoint_dir:
        assert checkpoint_dir == committed
    monkeypatch.setattr(checkpoint_format, "resolve_checkpoint_dir", lambda path: removed)
    with pytest.raises(CheckpointError, match="its latest checkpoint was removed three times as it was about to "
                                              "be read"):
        with checkpoint_format.reading_checkpoint(tmp_path):
            pytest.fail("read a removed checkpoint")


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
    # there but damaged since its commit: megatron's "is not a distributed checkpoint" named neither file
    iteration_dir(tmp_path, 9).mkdir()
    (iteration_dir(tmp_path, 9) / "common.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"names iteration 9, but .*iter_0000009 is not a whole checkpoint "
                                              r"\(its metadata.json is gone\): write the iteration to resume from"):
        latest_checkpoint(tmp_path)


def test_a_marker_that_names_no_iteration_is_refused_as_a_checkpoint_error(tmp_path):
    """A marker cut short or edited by hand must say which file is wrong, not fail in int() deep in a resume."""
    for text in ("", "12abc\n", "-3\n"):
        (tmp_path / LATEST_FILE).write_text(text)
        with pytest.raises(CheckpointError, match="expected an iteration number"):
            read_latest_iteration(tmp_path)


def test_an_output_dir_resolves_to_its_marker_s_checkpoint_and_one_without_config_is_refused(tmp_path):
    """Conversion and inference take a run's output_dir; a checkpoint without its config.yaml (the commit
    writes it last, before the rename) cannot be rebuilt into a model and is refused by name."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for iteration in (3, 6):
        _whole(checkpoints, iteration)
        (iteration_dir(checkpoints, iteration) / "config.yaml").write_text("{}")
    (checkpoints / LATEST_FILE).write_text("3\n")
    assert resolve_checkpoint_dir(tmp_path) == iteration_dir(checkpoints, 3)
    assert resolve_checkpoint_dir(checkpoints) == iteration_dir(checkpoints, 3)
    assert resolve_checkpoint_dir(iteration_dir(checkpoints, 6)) == iteration_dir(checkpoints, 6)
    (iteration_dir(checkpoints, 3) / "config.yaml").unlink()
    with pytest.raises(CheckpointError, match="is not a megadiff checkpoint"):
        resolve_checkpoint_dir(tmp_path)


def test_virtual_pipeline_chunks_are_saved_under_one_key_each():
    """Two chunks under one key would save one chunk's weights over the other's."""
    assert model_keys(1) == ["model"]
    assert model_keys(2) == ["model0", "model1"]


def _writer(monkeypatch, directory):
    from megadiff.checkpoint import training_checkpoint

    # no manager process for megatron's writers: nothing here writes through them
    monkeypatch.setattr(training_checkpoint, "start_write_results_queue", lambda: None)
    return training_checkpoint.CheckpointWriter(directory, cfg=None)


def test_a_save_failing_with_an_os_error_is_reported_with_the_checkpoint_kept(tmp_path, monkeypatch):
    """An OSError outside megatron's writers (the staging mkdir, the commit's config or rename on a full disk)
    must read as the writers' failures do: what is kept, its partial files removed to give back the space."""
    writer = _writer(monkeypatch, tmp_path)
    _commit_staged(tmp_path, 2, keep_last=None)
    _staging_dir(tmp_path, 4).mkdir()
    (_staging_dir(tmp_path, 4) / "half_written.distcp").write_text("x")
    with pytest.raises(CheckpointError, match=r"iteration 4 could not be written .*\(\[Errno 28\] No space left on "
                                              r"device\); the run's last checkpoint, .*iter_0000002, is kept"):
        with writer._failure_reported(4):
            raise OSError(28, "No space left on device")
    assert _saved(tmp_path) == ["iter_0000002"] and read_latest_iteration(tmp_path) == 2


def test_a_first_save_failing_says_there_is_no_checkpoint_yet(tmp_path, monkeypatch):
    writer = _writer(monkeypatch, tmp_path)
    with pytest.raises(CheckpointError, match="the run has no checkpoint yet"):
        with writer._failure_reported(2):
            raise PermissionError(13, "Permission denied")


def test_a_writer_s_commit_carries_the_run_s_config_and_applies_its_keep_last(tmp_path, monkeypatch):
    """The config.yaml is what conversion and resumes rebuild the model from; keep_last bounds the disk a run
    takes. Only the slow end-to-end runs checked either."""
    from megadiff.checkpoint.format import checkpoint_config
    from megadiff.config.loader import build_config

    writer = _writer(monkeypatch, tmp_path)
    writer.cfg, writer.keep_last = build_config({}, ["model.num_layers=3"]), 1
    for iteration in (2, 4):
        _staging_dir(tmp_path, iteration).mkdir()
        writer._commit_fn(iteration, None)()
    assert _saved(tmp_path) == ["iter_0000004"] and read_latest_iteration(tmp_path) == 4
    assert checkpoint_config(iteration_dir(tmp_path, 4)).model.num_layers == 3


def test_a_missing_path_is_refused_as_missing(tmp_path):
    """A mistyped --load must say the path does not exist, not that some directory is no checkpoint."""
    with pytest.raises(CheckpointError, match=f"checkpoint path does not exist: {tmp_path / 'no_such_run'}"):
        resolve_checkpoint_dir(tmp_path / "no_such_run")


class _FakeWrites:
    """dist_checkpointing.save as each rank's writes: a shard and the metadata into the directory given, noting
    the marker as it stood then; `async_sharded_save` returns a request whose finalize functions (the commit) a
    _FakeQueue runs."""

    def __init__(self, checkpoints):
        self.checkpoints, self.marker_while_writing = checkpoints, []

    def save(self, state, directory, sharded_strategy=None, async_sharded_save=False):
        if async_sharded_save:
            return _FakeRequest(lambda: self.save(state, directory))
        self.marker_while_writing.append(read_latest_iteration(self.checkpoints))
        for name in ("__0_0.distcp", "metadata.json"):
            (Path(directory) / name).write_text(str(state["train_state"]))


class _FakeRequest:
    preload_fn = None  # its writes read the state itself, staged nowhere

    def __init__(self, write):
        self.write, self.finalize_fns = write, []

    def add_finalize_fn(self, fn):
        self.finalize_fns.append(fn)


class _FakeQueue:
    """megatron's AsyncCallsQueue: the writes run in the background, finalized when asked to block."""

    def __init__(self):
        self.pending = []

    def schedule_async_request(self, request):
        self.pending.append(request)

    def maybe_finalize_async_calls(self, blocking):
        done = self.pending if blocking else []
        for request in done:
            request.write()
            for fn in request.finalize_fns:
                fn()
        self.pending = [request for request in self.pending if request not in done]
        return bool(done)

    def close(self):
        assert not self.pending


def _saving_writer(monkeypatch, directory, async_save: bool):
    """A CheckpointWriter whose model, optimizer and RNG states are placeholders and whose files come from
    _FakeWrites: what is left to check is the order of its staging, writes and commit."""
    from megadiff.checkpoint import training_checkpoint
    from megadiff.config.loader import build_config

    writes = _FakeWrites(directory)
    monkeypatch.setattr(training_checkpoint, "dist_checkpointing", writes)
    monkeypatch.setattr(training_checkpoint, "model_sharded_state", lambda chunks: {"model": {}})
    monkeypatch.setattr(training_checkpoint, "optimizer_sharded_state", lambda *args, **kwargs: {})
    monkeypatch.setattr(training_checkpoint, "_rng_sharded_object", lambda states: None)
    writer = _writer(monkeypatch, directory)
    writer.cfg = build_config({}, [])
    if async_save:
        writer.queue = _FakeQueue()
    return writer, writes


def test_a_save_writes_while_the_previous_checkpoint_is_latest_and_removes_killed_saves_leftovers(
        tmp_path, monkeypatch):
    """The marker may name the new checkpoint only once its files are all written (a kill while writing must
    leave the previous one for the rerun), and the staged files of a save killed earlier, which nothing else
    removes, take no disk after the next save."""
    writer, writes = _saving_writer(monkeypatch, tmp_path, async_save=False)
    _commit_staged(tmp_path, 2, keep_last=None)
    _staging_dir(tmp_path, 3).mkdir()  # a save killed before its commit
    (_staging_dir(tmp_path, 3) / "half_written.distcp").write_text("x")
    writer.save(4, [], None, {"iteration": 4})
    writer.close()
    assert writes.marker_while_writing == [2]
    assert _saved(tmp_path) == ["iter_0000002", "iter_0000004"] and read_latest_iteration(tmp_path) == 4
    assert (iteration_dir(tmp_path, 4) / "metadata.json").read_text() == str({"iteration": 4})


def test_an_async_save_is_committed_before_the_next_save_starts(tmp_path, monkeypatch):
    """The next save's start removes staged directories as a killed save's leftovers: the one still in flight
    must have been committed first, else its checkpoint is lost."""
    writer, writes = _saving_writer(monkeypatch, tmp_path, async_save=True)
    for iteration in (2, 4):
        writer.save(iteration, [], None, {"iteration": iteration})
    assert read_latest_iteration(tmp_path) == 2  # the first committed, the second still in flight
    writer.close()
    assert writes.marker_while_writing == [None, 2]
    assert _saved(tmp_path) == ["iter_0000002", "iter_0000004"] and read_latest_iteration(tmp_path) == 4


def test_a_failed_write_names_what_came_of_it_and_on_which_rank(tmp_path):
    """megatron gives the failures to its coordinator rank only; the other ranks must still say something,
    not fail on an empty failures mapping."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megadiff.checkpoint.weights import write_failure

    full = OSError(28, "No space left on device")
    failed = CheckpointException("writes failed", {1: (RuntimeError(f"Worker failure: {full}"), None)})
    assert write_failure(failed) == f"{full}, on rank 1"
    assert "rank 0's message names the rank" in write_failure(CheckpointException("writes failed", {}))
    assert write_failure(full) == str(full)


def test_a_commit_whose_rename_fails_leaves_the_marker_on_the_previous_checkpoint(tmp_path):
    """The marker moves only once the new checkpoint has its name: a commit that fails (or is killed) at the
    rename must leave the marker naming the previous checkpoint, not one that does not exist."""
    _commit_staged(tmp_path, 2, keep_last=None)
    with pytest.raises(FileNotFoundError):  # iteration 4 never staged: its rename fails
        commit_iteration(tmp_path, 4, LATEST_FILE, "4\n", keep_last=None)
    assert read_latest_iteration(tmp_path) == 2 and _saved(tmp_path) == ["iter_0000002"]


def test_an_iteration_committed_again_replaces_the_earlier_one_whole(tmp_path):
    """A checkpoint written twice at one iteration (a signal right after a periodic save) must end up with the
    second save's files only, and no staged directory left behind."""
    _staging_dir(tmp_path, 4).mkdir()
    (_staging_dir(tmp_path, 4) / "first.distcp").write_text("1")
    commit_iteration(tmp_path, 4, LATEST_FILE, "4\n", keep_last=None)
    _staging_dir(tmp_path, 4).mkdir()
    (_staging_dir(tmp_path, 4) / "second.distcp").write_text("2")
    commit_iteration(tmp_path, 4, LATEST_FILE, "4\n", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LATEST_FILE, "iter_0000004"])
    assert [p.name for p in iteration_dir(tmp_path, 4).iterdir()] == ["second.distcp"]


def test_an_iteration_committed_again_over_a_link_to_its_moved_copy_replaces_the_link(tmp_path):
    """A run restarted from an earlier checkpoint saves again at an iteration whose checkpoint was moved to other
    storage and linked back: the save failed at its commit (rmtree refuses a link), its files all written."""
    checkpoints, archive = tmp_path / "checkpoints", tmp_path / "archive"
    (archive / "iter_0000004").mkdir(parents=True)
    (archive / "iter_0000004" / "first.distcp").write_text("1")
    checkpoints.mkdir()
    iteration_dir(checkpoints, 4).symlink_to(archive / "iter_0000004", target_is_directory=True)
    _staging_dir(checkpoints, 4).mkdir()
    (_staging_dir(checkpoints, 4) / "second.distcp").write_text("2")
    commit_iteration(checkpoints, 4, LATEST_FILE, "4\n", keep_last=None)
    assert not iteration_dir(checkpoints, 4).is_symlink() and read_latest_iteration(checkpoints) == 4
    assert [p.name for p in iteration_dir(checkpoints, 4).iterdir()] == ["second.distcp"]
    assert [p.name for p in (archive / "iter_0000004").iterdir()] == ["first.distcp"]  # not the run's to delete


def test_keep_last_counts_only_committed_checkpoint_directories_by_number(tmp_path):
    """A save still staged (async, in flight), other names under the prefix, or a file that happens to look
    like a checkpoint are no checkpoints: keep_last must neither fail on them, remove them, nor count them
    (counting one would remove a real checkpoint in its place). Numbers order by value past 7 digits."""
    from megadiff.files import numbered_dirs

    _staging_dir(tmp_path, 10**7 + 5).mkdir()  # a later save still being written
    (tmp_path / "iter_notes").mkdir()
    (tmp_path / "iter_0000005").write_text("not a checkpoint")
    for iteration in (9_999_999, 2, 10**7, 4):
        iteration_dir(tmp_path, iteration).mkdir()
    assert [number for number, _ in numbered_dirs(tmp_path, "iter_")] == [2, 4, 9_999_999, 10**7]
    _commit_staged(tmp_path, 10**7 + 1, keep_last=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        LATEST_FILE, "iter_0000004", "iter_0000005", "iter_notes", _staging_dir(tmp_path, 10**7 + 5).name,
        "iter_9999999", "iter_10000000", "iter_10000001"])


def test_write_atomically_syncs_before_renaming_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    """The data must reach the disk before its name does (a power loss after the rename could otherwise leave an
    empty file under the final name); a write that fails leaves the previous file and no temporary behind, and
    a missing parent directory is made."""
    import os

    from megadiff import files

    steps = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: steps.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(files.os, "replace", lambda src, dst: steps.append("replace") or real_replace(src, dst))
    target = tmp_path / "new" / "dir" / "report.json"
    files.write_atomically(target, b"first")
    assert steps == ["fsync", "replace"] and target.read_bytes() == b"first"

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(target, b"second")
    assert [p.name for p in target.parent.iterdir()] == ["report.json"] and target.read_bytes() == b"first"


def test_exclusive_lock_excludes_other_holders_until_released(tmp_path):
    """flock locks belong to an open file: a second open of the lock file (another process's, as far as flock
    is concerned) must not get even a shared lock while it is held, and gets an exclusive one afterwards."""
    import fcntl

    from megadiff.files import exclusive_lock

    lock = tmp_path / "sub" / "x.lock"
    with exclusive_lock(lock):
        with open(lock) as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert lock.exists()  # lock files stay


def test_a_held_lock_names_its_holder_and_is_free_once_it_ends(tmp_path, monkeypatch):
    """hold_lock: another process's lock is refused with the host and pid it wrote, taken once that process
    has ended, and held until its handle closes; a filesystem that takes no locks gives no handle."""
    import errno
    import fcntl
    import os
    import socket

    from megadiff import files
    from tests.conftest import lock_held_elsewhere

    lock = tmp_path / "run" / "run.lock"
    with lock_held_elsewhere(lock) as pid:
        with pytest.raises(files.HeldElsewhere, match=f"host {socket.gethostname()}, pid {pid}$"):
            files.hold_lock(lock)
    handle = files.hold_lock(lock)
    assert lock.read_text() == f"host {socket.gethostname()}, pid {os.getpid()}\n"  # the last holder's words gone
    with pytest.raises(files.HeldElsewhere):
        files.hold_lock(lock)
    handle.close()
    files.hold_lock(lock).close()
    with open(lock, "w") as starting:  # a holder between its lock and its words (or the words of none before it)
        fcntl.flock(starting, fcntl.LOCK_EX)
        with pytest.raises(files.HeldElsewhere, match="^a process that wrote nothing yet$"):
            files.hold_lock(lock)

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert files.hold_lock(lock) is None


def _staged_copies_worker(rank: int, world_size: int, directory: str, out: str) -> None:
    """An async save whose tensors, as on CUDA, are staged into new host tensors (on CPU megatron's preload hands
    the writer the model's own): whether they are still referenced while the writer writes, and after."""
    import gc
    import json
    import weakref

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megadiff.checkpoint.training_checkpoint import CheckpointWriter
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine
    from tests.parity_worker import MODEL

    staged = []
    preload = FileSystemWriterAsync.preload_tensors

    def staged_on_the_host(write_buckets, non_blocking=True):
        buckets = [(name, key, (data, [(item, tensor.clone()) for item, tensor in tensors]))
                   for name, key, (data, tensors) in preload(write_buckets, non_blocking)]
        staged.extend(weakref.ref(tensor) for *_, (_, tensors) in buckets for _, tensor in tensors)
        return buckets

    FileSystemWriterAsync.preload_tensors = staticmethod(staged_on_the_host)
    cfg = build_config({}, MODEL + ["model.variant=diff"], world_size)
    initialize(cfg.parallel, seed=0)
    engine = build_engine(cfg)
    writer = CheckpointWriter(directory, cfg, async_save=True)
    writer.save(1, engine.unwrapped(), engine.optimizer, {"iteration": 1})
    gc.collect()
    kept_while_writing = bool(staged) and all(ref() is not None for ref in staged)
    writer.close()
    gc.collect()
    released = all(ref() is None for ref in staged)
    with open(out, "w") as handle:
        json.dump({"kept_while_writing": kept_while_writing, "released": released}, handle)
    shutdown()


def test_an_async_saves_staged_host_copies_live_until_its_writer_has_written_them(tmp_path):
    """megatron-core 0.16.1 forks the writer and drops the pinned host copies it reads (megatron PR #2288):
    pinned memory is not copy-on-write, and the next pinned allocations (the data loader's batches) reused it
    under the writer. The copies must stay referenced until the write has finished, and no longer."""
    import json

    from tests.distributed import run_ranks

    out = tmp_path / "report.json"
    run_ranks(1, _staged_copies_worker, str(tmp_path / "checkpoints"), str(out))
    assert json.loads(out.read_text()) == {"kept_while_writing": True, "released": True}
