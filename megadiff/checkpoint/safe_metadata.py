"""A checkpoint's `.metadata` read without running code from it.

torch's checkpoint reader unpickles `.metadata` whole (pickle.load, not torch.load's weights_only): a checkpoint
from elsewhere (downloaded, shared, a 64K extension's base) ran whatever code its pickle named, as it was read.
Read here first, it may only name what torch's checkpoint writer puts there: its metadata dataclasses and enums,
torch.Size, dtypes and layouts. Anything else is refused before the module that holds it is even imported.
"""
from __future__ import annotations

import dataclasses
import enum
import pickle
from pathlib import Path

import torch

METADATA_FILE = ".metadata"
CHECKPOINT_MODULE_PREFIX = "torch.distributed.checkpoint."
LAYOUT_DECODER = ("torch.serialization", "_get_layout")  # how a torch.layout pickles


def _may_import(module: str, name: str) -> bool:
    return module == "torch" or module.startswith(CHECKPOINT_MODULE_PREFIX) or (module, name) == LAYOUT_DECODER


def _is_metadata_type(module: str, name: str, found) -> bool:
    if module.startswith(CHECKPOINT_MODULE_PREFIX):  # defined there: a dotted name may reach other modules' types
        return (isinstance(found, type) and found.__module__.startswith(CHECKPOINT_MODULE_PREFIX)
                and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)))
    if module == "torch":
        return found is torch.Size or isinstance(found, torch.dtype)
    return (module, name) == LAYOUT_DECODER


class MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that resolves only the globals torch's checkpoint metadata is made of."""

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if _may_import(module, name) else None
        if not _is_metadata_type(module, name, found):
            raise pickle.UnpicklingError(f"{METADATA_FILE} names {module}.{name}, which no checkpoint's metadata "
                                         "holds: refused unread (loading it would run code from the checkpoint)")
        return found


def refuse_unsafe_metadata(checkpoint_dir: str | Path) -> None:
    """Inside damage_reported, before torch's reader unpickles the checkpoint's `.metadata`: an UnpicklingError
    where it names anything but torch's checkpoint metadata types."""
    with open(Path(checkpoint_dir) / METADATA_FILE, "rb") as file:
        MetadataUnpickler(file).load()
