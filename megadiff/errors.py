"""The one base class of errors whose message is meant for the user: the CLI prints it, no traceback."""
from __future__ import annotations

from typing import Callable, TypeVar

Result = TypeVar("Result")


class MegadiffError(Exception):
    """A config, data, checkpoint or conversion that cannot work, explained in the message."""


def refused_together(check: Callable[[], Result]) -> Result:
    """`check()` on every rank (collective): where it raised a MegadiffError on some ranks, every rank
    raises, each failing rank its own error and the others the first one's. A check reading a rank's own
    files (node-local copies of a model) may fail on one node only, whose ranks would otherwise leave the
    others waiting in their next collective until its timeout. In one process: `check()`."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return check()
    try:
        result, refusal = check(), None
    except MegadiffError as err:
        result, refusal = None, err
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    for rank, message in enumerate(messages):
        if message is not None:
            raise MegadiffError(f"rank {rank} refused the run: {message}")
    return result
