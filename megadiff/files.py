"""Crash-safe file writing: temporary names renamed into place, and an inter-process lock.

A reader never sees a half-written file under its final name; a crash leaves only
`<name>.tmp-<pid>-<random>` files, which nothing treats as output.
"""
from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterator


def temporary_name(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def write_atomically(path: str | Path, data: bytes) -> None:
    with written_atomically(path) as out:
        out.write(data)


@contextlib.contextmanager
def written_atomically(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file that takes `path`'s name once the block has written it whole (nothing at `path` where the
    block fails)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


STAGING_SUFFIX = ".partial"


def file_in_the_way(directory: str | Path) -> Path | None:
    """`directory` itself, or the nearest of its parents that exists, where that is no directory (a file, a link
    to nothing): what a command writing into `directory` would fail on at its first write, after its start-up."""
    path = Path(directory).absolute()
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def raise_if_a_file_is_in_the_way(path: str | Path, error: Callable[[str], Exception]) -> None:
    """`error("<path> is a file")` (or "<path> lies under <file>, a file") where file_in_the_way finds one."""
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise error(f"{path} is a file" if blocker == Path(path).absolute() else f"{path} lies under {blocker}, a file")


def staging_dir(final: Path) -> Path:
    """Where a checkpoint directory is written before `commit_staged` gives it its name."""
    return final.with_name(final.name + STAGING_SUFFIX)


def remove_staging_leftovers(directory: str | Path) -> list[str]:
    """What saves killed before their commit left (one process, before a save, or as a run starts); their names."""
    leftovers = sorted(Path(directory).glob(f"*{STAGING_SUFFIX}"))
    for leftover in leftovers:
        shutil.rmtree(leftover)
    return [leftover.name for leftover in leftovers]


def publish_staged(final: Path) -> None:
    """Give the staged directory (every file written) its name, in place of a directory of that name: a crash
    never leaves the name on a directory that is not whole."""
    if final.is_symlink():  # one moved to other storage and linked back: the link goes, the copy it names stays
        final.unlink()  # (rmtree refuses a link, so the save failed once its files were all written)
    elif final.exists():  # written again (a checkpoint: e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.replace(staging_dir(final), final)


def commit_staged(final: Path, marker: Path, marker_text: str) -> None:
    """publish_staged, then move the marker to it. A crash at any point leaves the previous checkpoint and
    marker as they were (keep_last would count a checkpoint not whole, and remove a whole one in its place)."""
    publish_staged(final)
    write_atomically(marker, marker_text.encode())


ITERATION_PREFIX = "iter_"  # checkpoints/iter_0000500: megatron's naming, and DeepSpeed's tag of each save


def iteration_dir(checkpoints_dir: str | Path, iteration: int) -> Path:
    return Path(checkpoints_dir) / f"{ITERATION_PREFIX}{iteration:07d}"


def commit_iteration(checkpoints_dir: Path, iteration: int, marker: str, marker_text: str,
                     keep_last: int | None, kept_before: int | None = None) -> None:
    """One process, once every rank's files of the staged iteration_dir are complete: commit_staged with the
    `marker` file of `checkpoints_dir`, then the checkpoints beyond `keep_last` removed (remove_older_numbered's
    `kept_before` kept)."""
    commit_staged(iteration_dir(checkpoints_dir, iteration), checkpoints_dir / marker, marker_text)
    if keep_last:
        remove_older_numbered(checkpoints_dir, ITERATION_PREFIX, iteration, keep_last, kept_before)


def numbered_dirs(directory: str | Path, prefix: str) -> list[tuple[int, Path]]:
    """The directories `<prefix><number>` in `directory` (checkpoints), by number."""
    return sorted((int(path.name.removeprefix(prefix)), path) for path in Path(directory).glob(f"{prefix}*")
                  if path.is_dir() and path.name.removeprefix(prefix).isdigit())


def remove_older_numbered(directory: str | Path, prefix: str, newest: int, keep: int,
                          kept_before: int | None = None) -> None:
    """Of the directories `<prefix><number>` (checkpoints), keep the last `keep` numbered up to `newest`, the
    newest numbered below `kept_before` (a training run's last checkpoint before the streak of skipped steps it is
    in: those saved during it hold its weights again, and would rotate away the one to go back to), and those
    being read (removed at a later call). Later numbers (a run restarted from an earlier checkpoint left them)
    are not counted, so the one just committed can never be removed."""
    for leftover in Path(directory).glob(f"{prefix}*{REMOVING_SUFFIX}"):  # a removal killed part way
        shutil.rmtree(leftover, ignore_errors=True)
    older = [entry for entry in numbered_dirs(directory, prefix) if entry[0] <= newest]
    before = [entry for entry in older if kept_before is not None and entry[0] < kept_before]
    for entry in older[:-keep]:
        if entry not in before[-1:]:
            _remove_unless_read(entry[1])


# in a directory being read (a checkpoint that generate or convert loads while its run goes on training)
READERS_LOCK = ".readers.lock"
REMOVING_SUFFIX = ".removing"


def _remove_unless_read(path: Path) -> None:
    """Moved out of its name holding its readers' lock exclusively, then removed: a reader arriving meanwhile
    finds no directory there, or waits and then finds none (removed in place, rmtree could take the lock file
    before the rest, and a reader then lock a new one in a directory going away)."""
    try:
        handle = open(path / READERS_LOCK, "a")
    except OSError:  # already gone, or not ours to write in: rmtree does what it can
        shutil.rmtree(path, ignore_errors=True)
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        except OSError:  # a filesystem without locks
            pass
        doomed = path.with_name(path.name + REMOVING_SUFFIX)
        try:
            os.rename(path, doomed)
        except OSError:
            doomed = path
        shutil.rmtree(doomed, ignore_errors=True)


def reading(directory: str | Path) -> contextlib.AbstractContextManager:
    """A shared lock on `directory` while the block reads it, which remove_older_numbered respects (waiting while
    it moves the directory away); read without one where none can be taken (a directory gone, or not ours)."""
    return held_shared(Path(directory) / READERS_LOCK, wait_seconds=math.inf)


def exclusive_lock(path: str | Path, waiting_for: str = "another process") -> contextlib.AbstractContextManager:
    """Hold an exclusive lock on `path` (created if needed; left in place, as lock files must be), saying on
    standard error what it waits for where another process holds it (a wait that says nothing looks like a hang)."""
    return _waited_lock(path, fcntl.LOCK_EX, waiting_for)


def shared_lock(path: str | Path, waiting_for: str = "another process") -> contextlib.AbstractContextManager:
    """exclusive_lock's shared lock: held by any number of processes at once, waiting while one holds it
    exclusively (and saying so)."""
    return _waited_lock(path, fcntl.LOCK_SH, waiting_for)


@contextlib.contextmanager
def _waited_lock(path: str | Path, operation: int, waiting_for: str) -> Iterator[None]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            try:
                fcntl.flock(handle, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"megadiff: waiting for {waiting_for} (holding {path})", file=sys.stderr, flush=True)
                fcntl.flock(handle, operation)
        except OSError:  # ENOLCK, ENOSYS: a filesystem without locks (Lustre without -o flock): none to take
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def claimed(path: str | Path, refused: Callable[[str], Exception]) -> Iterator[None]:
    """hold_lock(path) while the block runs, its file removed after (nothing left beside a command's output);
    refused(the holder) raised where another process holds it."""
    path = Path(path)
    while True:
        try:
            handle = hold_lock(path)
        except HeldElsewhere as holder:
            raise refused(str(holder)) from None
        except PermissionError:  # beside an output in a directory not ours to write: nothing to hold
            handle = None
        if handle is None or _names(path, handle):
            break
        handle.close()  # locked the file its holder removed as it let go: the one at `path` now is the lock
    try:
        yield
    finally:
        if handle is not None:
            path.unlink(missing_ok=True)
            handle.close()


def _names(path: Path, handle: IO) -> bool:
    try:
        return os.path.samestat(os.stat(path), os.fstat(handle.fileno()))
    except FileNotFoundError:
        return False


class HeldElsewhere(Exception):
    """Another process holds the lock: its host and pid, as it wrote them."""


@contextlib.contextmanager
def held_shared(path: str | Path, wait_seconds: float = 0.0) -> Iterator[None]:
    """A shared lock on `path` (created if need be) while the block runs; HeldElsewhere where a process holds it
    exclusively for longer than `wait_seconds`. Nothing is held where nothing can be (a file not ours to write,
    a filesystem without locks)."""
    try:
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise HeldElsewhere("a process writing it") from None
                time.sleep(0.5)
            except OSError:
                break
        yield


def hold_lock(path: str | Path) -> IO | None:
    """An exclusive lock on `path` (created if needed), held until the returned handle is closed or the process
    ends, with this process's host and pid written in it; HeldElsewhere where another process holds it. None
    where the filesystem takes no locks (Lustre mounted without `flock`): nothing to hold then."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that wrote nothing yet"
        handle.close()
        raise HeldElsewhere(holder) from None
    except OSError:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
        handle.close()
        return None
    handle.truncate(0)
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    handle.flush()
    return handle


# a shared filesystem (NFS, Lustre) may show a file another node just wrote a moment late (its attribute and
# directory caches): what one node expects of another's writes is looked for this long before it is missing
VISIBILITY_WAIT_SECONDS = 5.0


def appears(path: str | Path, directory: bool = False, matching: str | None = None) -> bool:
    """Whether `path` exists here (as a `directory` where asked; as a directory holding a file whose name matches
    the glob pattern `matching` where one is given) within VISIBILITY_WAIT_SECONDS; OSError (a stale handle, a
    dead mount) goes to the caller."""
    path, deadline = Path(path), time.monotonic() + VISIBILITY_WAIT_SECONDS
    while not _present(path, directory, matching):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _present(path: Path, directory: bool, matching: str | None) -> bool:
    if matching is not None:
        return any(path.glob(matching))
    return path.is_dir() if directory else path.exists()
