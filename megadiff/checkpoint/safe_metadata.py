"""A checkpoint's `.metadata` read without running code from it.

torch's checkpoint reader unpickles `.metadata` whole (pickle.load, not torch.load's weights_only): a checkpoint
from elsewhere (downloaded, shared, a 64K extension's base) ran whatever code its pickle named, as it was read.
Read here first, it may only name what torch's checkpoint writer puts there: its metadata dataclasses and enums,
torch.Size, dtypes and layouts. Anything else is refused before the module that holds it is even imported.

Read once: megatron's checks and loads read it again and again (a model's load four times, each rank, from
storage every rank shares); within metadata_read_once they unpickle, as here, the bytes read first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import pickle
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


# the `.metadata` files read by the metadata_read_once blocks under way: their bytes, by resolved path
_READ: dict[Path, bytes] = {}


@contextlib.contextmanager
def metadata_read_once(checkpoint_dir: str | Path) -> Iterator[None]:
    """Inside damage_reported: the checkpoint's `.metadata` read, and an UnpicklingError where it names anything
    but torch's checkpoint metadata types; torch's readers of it within the block unpickle these bytes (as
    safely) instead of the file. A block within another's for the same checkpoint reads nothing more."""
    path = (Path(checkpoint_dir) / METADATA_FILE).resolve()
    if path in _READ:
        yield
        return
    data = path.read_bytes()
    MetadataUnpickler(io.BytesIO(data)).load()
    original = FileSystemReader.read_metadata
    _READ[path] = data
    FileSystemReader.read_metadata = _reading_what_was_read(original)
    try:
        yield
    finally:
        FileSystemReader.read_metadata = original
        del _READ[path]


def _reading_what_was_read(read_metadata):
    """FileSystemReader.read_metadata, taking a `.metadata` read by metadata_read_once from its bytes."""
    @functools.wraps(read_metadata)
    def read(reader: FileSystemReader, *args, **kwargs) -> Metadata:
        data = None if kwargs.get("rank") is not None else _READ.get((Path(reader.path) / METADATA_FILE).resolve())
        if data is None:
            return read_metadata(reader, *args, **kwargs)
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
        # as torch's reader leaves it: the id of this load on its storage metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata
    return read
