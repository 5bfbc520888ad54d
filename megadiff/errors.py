"""The one base class of errors whose message is meant for the user: the CLI prints it, no traceback."""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

Result = TypeVar("Result")


class MegadiffError(Exception):
    """A config, data, checkpoint or conversion that cannot work, explained in the message."""


def first_line(err: Exception) -> str:
    """A library's error message, whose later lines often point at places not read here (the hub), in one
    line: its first, or its type where it has no text."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def lacking_weights(directory, missing: Iterable[str]) -> str | None:
    """The weights transformers' from_pretrained reported missing (output_loading_info's missing_keys) as a
    refusal's text, None where none is: it draws them at random and says so only in its load report, so a
    LlamaModel's directory (the decoder saved without its LM head) ran as a causal LM with a random head."""
    names = sorted(missing)
    if not names:
        return None
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"{directory} lacks {shown}, which transformers would draw at random (a base model saved without its "
            "LM head?): give the directory of the causal LM itself")


def refused_together(check: Callable[[], Result]) -> Result:
    """`check()` on every rank (collective): where it raised on some ranks, every rank raises, each failing
    rank its own error and the others the first one's, as the same kind of refusal (the same exit code; any
    other error as a MegadiffError naming it). A check reading a rank's own files (node-local copies of a
    model) may fail on one node only, whose ranks would otherwise leave the others waiting in their next
    collective until its timeout. In one process: `check()`."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return check()
    try:
        result, failure = check(), None
    except Exception as err:  # noqa: BLE001 -- every rank must hear of it, whatever it is
        result, failure = None, err
    # a refusal's class travels (megadiff's are module-level, so picklable), any other error's name only
    shared = None if failure is None else (
        type(failure) if isinstance(failure, MegadiffError) else type(failure).__name__, str(failure))
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, shared)
    if failure is not None:
        raise failure
    for rank, failed in enumerate(failures):
        if failed is not None:
            kind, message = failed
            if isinstance(kind, type):
                raise kind(f"rank {rank} refused the run: {message}")
            raise MegadiffError(f"rank {rank} failed: {kind}: {message}")
    return result
