"""That every rank runs the same job: the same config, the same starting checkpoint, and the same shared
directories (the output_dir every rank writes its checkpoint shards into; pre-training's data cache, whose
dataset indices rank 0 builds for all).

A node whose output_dir was not the shared directory (a node-local path, a failed mount) trained to the
end with exit 0 while every checkpoint lacked its shards; a rank with another config (a stale copy of
the YAML on one node) trained its replica apart, or hung in a collective the others never reached, and
one that saw an older checkpoint resumed from it. Checked once, after the process group forms.
"""
from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from megadiff.config import ConfigError
from megadiff.errors import refused_together

PROBE_PREFIX = ".rank0-probe-"
# a shared filesystem may show another node's new file a moment late (attribute caches)
PROBE_WAIT_SECONDS = 5.0


def check_ranks_agree(shared: dict[str, str | Path], facts: dict[str, object]) -> None:
    """Every rank sees the files rank 0 writes into the `shared` directories (by config key) and holds rank 0's
    `facts` (JSON-like values; nested dicts are compared key by key). Collective; refused on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    probes = [refused_together(lambda: [_write_probe(Path(d)) for d in shared.values()] if rank == 0 else None)]
    dist.broadcast_object_list(probes, src=0)
    views = {key: (str(directory), _sees(Path(directory) / probe))
             for (key, directory), probe in zip(shared.items(), probes[0])}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), views, _flat(facts)))
    if rank == 0:
        for directory, probe in zip(shared.values(), probes[0]):
            (Path(directory) / probe).unlink(missing_ok=True)
    for key in shared:
        _refuse_unshared(key, [(host, *seen_by[key]) for host, seen_by, _ in gathered])
    differences = _differences([flat for *_, flat in gathered])
    if differences:
        raise ConfigError("the ranks were started differently (a config file or data that differs between nodes?): "
                          + "; ".join(differences))


def _refuse_unshared(key: str, views: list[tuple[str, str, bool]]) -> None:
    """views: each rank's (host, directory, whether it saw rank 0's file there)."""
    (first_host, first_path, _), blind = views[0], []
    for rank, (host, path, seen) in enumerate(views):
        if not seen:
            blind.append(f"{rank} ({host}{'' if path == first_path else f', at {path}'})")
    if blind:
        raise ConfigError(f"{key}: {first_path} is not the same directory on every node: rank "
                          f"{', '.join(blind[:3])}{f' and {len(blind) - 3} more' if len(blind) > 3 else ''} did not "
                          f"see the file rank 0 ({first_host}) wrote there; every rank reads and writes it (checkpoint "
                          "shards, dataset indices): give every node the same shared directory")


def _write_probe(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    (directory / name).touch()
    return name


def _sees(path: Path) -> bool:
    deadline = time.monotonic() + PROBE_WAIT_SECONDS
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _flat(facts: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for name, value in facts.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _differences(ranks: list[dict[str, object]]) -> list[str]:
    """"name: rank 0 has A, rank 2 has B" for each fact where a rank differs from rank 0."""
    lines = []
    for name in sorted(set().union(*ranks)):
        first = ranks[0].get(name)
        others = [f"rank {rank} has {facts.get(name)!r}" for rank, facts in enumerate(ranks)
                  if facts.get(name) != first]
        if others:
            lines.append(f"{name}: rank 0 has {first!r}, {', '.join(others[:3])}"
                         + (f" (and {len(others) - 3} more ranks)" if len(others) > 3 else ""))
    return lines
