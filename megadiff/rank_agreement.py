"""That every rank runs the same job: the same settings and start, and the same shared directories (the
output_dir every rank writes its checkpoint shards into; pre-training's data cache, whose dataset indices
rank 0 builds for all).

A node whose output_dir was not the shared directory (a node-local path, a failed mount) trained to the
end with exit 0 while every checkpoint lacked its shards; a rank with another config (a stale copy of
the YAML on one node) trained its replica apart, or hung in a collective the others never reached, and
one that saw an older checkpoint resumed from it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from megadiff.config import ConfigError
from megadiff.errors import first_line, refused_together
from megadiff.files import HeldElsewhere, appears, hold_lock

RUN_LOCK = "run.lock"  # in a run's output_dir, held by rank 0 while the run lasts

PROBE_PREFIX = ".rank0-probe-"


def check_ranks_agree(shared: dict[str, str | Path], facts: dict[str, object]) -> None:
    """Every rank sees the files rank 0 writes into the `shared` directories (by config key) and holds rank 0's
    `facts` (JSON values; nested dicts are compared key by key). Collective; refused on every rank, naming the
    ranks and hosts that differ."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    probes = [[]]
    if shared:  # the same keys on every rank: all of them take the probes' collectives, or none
        probes = [refused_together(lambda: _write_probes(list(shared.values())) if rank == 0 else None)]
        dist.broadcast_object_list(probes, src=0)
    views = {key: _view(Path(directory), probe) for (key, directory), probe in zip(shared.items(), probes[0])}
    flat = _flat(facts)
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, (digest, all(seen for _, seen, _ in views.values())))
    if rank == 0:
        _remove_probes(list(shared.values()), probes[0])
    if all(seen for _, seen in digests) and len({d for d, _ in digests}) == 1:
        return
    # only where they differ: every rank's whole view, which at thousands of ranks is a lot to gather
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), views, flat))
    for key in shared:
        _refuse_unshared(key, [(host, *seen_by[key]) for host, seen_by, _ in gathered])
    raise ConfigError("the ranks were started differently (a config file or data that differs between nodes?): "
                      + "; ".join(_differences([(host, facts) for host, _, facts in gathered])))


def comparable(settings: dict, node_local: tuple[str, ...]) -> dict:
    """A config's dump without the (dotted) keys naming inputs a node may hold its own copy of, at a path of its
    own: compare what they hold instead."""
    settings = json.loads(json.dumps(settings))
    for dotted in node_local:
        *sections, key = dotted.split(".")
        inner = settings
        for section in sections:
            inner = inner[section]
        inner.pop(key, None)
    return settings


def _write_probes(directories: list[str | Path]) -> list[str]:
    name, written = f"{PROBE_PREFIX}{secrets.token_hex(8)}", []
    try:
        for directory in directories:
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / name).touch()
            written.append(directory)
    except OSError:
        _remove_probes(written, [name] * len(written))
        raise
    return [name] * len(directories)


def _remove_probes(directories: list[str | Path], names: list[str]) -> None:
    for directory, name in zip(directories, names):
        with contextlib.suppress(OSError):
            (Path(directory) / name).unlink(missing_ok=True)


def _view(directory: Path, probe: str) -> tuple[str, bool, str | None]:
    """(the directory as this rank resolves it, whether it sees rank 0's probe there, why not where an error
    says: a stale handle, a dead mount, no permission)."""
    try:
        return str(directory.absolute()), appears(directory / probe), None
    except OSError as err:
        return str(directory.absolute()), False, first_line(err)


def _refuse_unshared(key: str, views: list[tuple[str, str, bool, str | None]]) -> None:
    """views: each rank's (host, directory, whether it saw rank 0's file there, the error that hid it)."""
    (first_host, first_path, _, _), blind = views[0], []
    for rank, (host, path, seen, problem) in enumerate(views):
        if not seen:
            where = "" if path == first_path else f", at {path}"
            blind.append(f"{rank} ({host}{where}{f': {problem}' if problem else ''})")
    if blind:
        raise ConfigError(f"{key}: {first_path} is not the same directory on every node: rank "
                          f"{', '.join(blind[:3])}{f' and {len(blind) - 3} more' if len(blind) > 3 else ''} did not "
                          f"see the file rank 0 ({first_host}) wrote there; every rank reads and writes it (checkpoint "
                          "shards, dataset indices): give every node the same shared directory")


def _flat(facts: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for name, value in facts.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _differences(ranks: list[tuple[str, dict[str, object]]]) -> list[str]:
    """"name: rank 0 (host) has A, rank 2 (host) has B" for each fact where a rank differs from rank 0."""
    (first_host, first), lines = ranks[0], []
    for name in sorted(set().union(*(facts for _, facts in ranks))):
        others = [f"rank {rank} ({host}) has {facts.get(name)!r}" for rank, (host, facts) in enumerate(ranks)
                  if facts.get(name) != first.get(name)]
        if others:
            lines.append(f"{name}: rank 0 ({first_host}) has {first.get(name)!r}, {', '.join(others[:3])}"
                         + (f" (and {len(others) - 3} more ranks)" if len(others) > 3 else ""))
    return lines


@contextlib.contextmanager
def claimed_run_directory(output_dir: str):
    """Rank 0 holds output_dir's run lock while the run lasts: a second run started on the same directory (launched
    twice, a requeued job whose predecessor still runs) is refused, rather than writing its checkpoints and metrics
    among the first's and resuming from them."""
    def claim():
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        try:
            return hold_lock(Path(output_dir) / RUN_LOCK)
        except HeldElsewhere as holder:
            raise ConfigError(f"output_dir {output_dir} is in use by another run ({holder}): wait for it to end, "
                              "or give this one another output_dir") from None

    lock = refused_together(claim)
    try:
        yield
    finally:
        if lock is not None:
            lock.close()


def ranks_where(holds: bool) -> list[str]:
    """"rank R (host)" of every rank where `holds` (e.g. its own loss was not finite, where every rank holds the
    NaN of their sum): what a cluster's operator looks for, a bad device or node. Collective over the world."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (holds, socket.gethostname()))
    return [f"rank {rank} ({host})" for rank, (held, host) in enumerate(everyone) if held]
