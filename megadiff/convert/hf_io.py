"""Reading and writing Hugging Face model directories.

An export holds what transformers reads (config.json, generation_config.json,
safetensors shards, tokenizer files, and for remote-code models the two .py files of
hf_code/) plus two megadiff sidecars that transformers ignores:
  megadiff_config.yaml           the source checkpoint's config, so from-hf restores
                                 what Hugging Face configs have no field for
  megadiff_unfolded.safetensors  DiffLlama exports only: the head-norm weights and
                                 output projections before folding, so from-hf gives
                                 back identical tensors (used only while o_proj still
                                 equals their fold, i.e. the model was not changed since)
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megadiff.config import Config, dump_config
from megadiff.config.loader import read_saved_config, saved_config
from megadiff.convert.hf_layout import ConversionError
from megadiff.data.conversations import chat_template_of, save_chat_template, stop_ids
from megadiff.errors import first_line
from megadiff.transformers4 import name_rope_for_transformers4

SIDECAR_CONFIG = "megadiff_config.yaml"
SIDECAR_UNFOLDED = "megadiff_unfolded.safetensors"
CODE_DIR = Path(__file__).resolve().parent / "hf_code"
CODE_FILES = ("configuration_megadiff.py", "modeling_megadiff.py")
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_INDEX = "pytorch_model.bin.index.json"
MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default (transformers' save_pretrained writes 50 GB ones)
WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")  # huggingface_hub's names


def _owned_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # split views share storage, which safetensors would treat as tied weights
    return {name: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
            for name, t in tensors.items()}


def _save_weights(layout: dict[str, torch.Tensor], parts: Iterable[dict[str, torch.Tensor]], directory: Path) -> None:
    """huggingface_hub's save_torch_state_dict files (shards and their index) of the tensors `parts` give, part
    after part in `layout`'s order; `layout`: those tensors on the meta device, views where they are views (which
    the split keeps in one shard, as it keeps views of one tensor). Each shard's tensors are copied as it is
    written, and the parts made as the shards need them: converting and copying them all first held the converted
    tensors of every layer (QKV regrouped, --dtype's casts: up to twice a bf16 model for an fp32 export) beside the
    source model."""
    from safetensors.torch import save_file

    split = _split(layout)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # the shards begun, by file name
    for part in parts:
        for name in list(part):
            filename = split.tensor_to_filename[name]
            shard = pending.setdefault(filename, {})
            shard[name] = part.pop(name)  # the part keeps none: it goes before the next one is made
            if len(shard) == len(split.filename_to_tensors[filename]):
                save_file(_owned_copies(pending.pop(filename)), str(directory / filename), metadata={"format": "pt"})
    if pending:
        raise ConversionError(f"no tensor converted for {', '.join(sorted(set().union(*pending.values())))}")
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))


def _split(layout: dict[str, torch.Tensor]):
    """split_torch_state_dict_into_shards of the tensors `layout` describes on the meta device."""
    from huggingface_hub import constants, split_state_dict_into_shards_factory

    return split_state_dict_into_shards_factory(layout, get_storage_size=_storage_bytes, get_storage_id=_storage_id,
                                                filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
                                                max_shard_size=MAX_SHARD_SIZE)


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()  # a view's: its whole storage, as huggingface_hub counts it


def _storage_id(tensor: torch.Tensor) -> tuple[int, int]:
    """Its storage's identity: huggingface_hub's (an address) gives none on the meta device."""
    return tensor.untyped_storage()._cdata, _storage_bytes(tensor)


EXPORT_STAGING = ".megadiff-export.partial"  # inside the export's directory: its files' own disk


class StagedExport:
    """An export written into <directory>/.megadiff-export.partial, checked there, and moved in, file by file,
    when whole and checked: killed or out of disk space while writing, or failing its check, it leaves an
    earlier export there as it was (writing in place deleted its shards first); failing, it gives the space
    back (killed, the next export does). Staged inside the directory, it is written on the directory's own
    disk (a mount point or a link to another disk too), and each file moves by a rename. Files no export
    writes stay."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        self.staged = directory / EXPORT_STAGING
        _remove(self.staged)  # a killed export's
        self.staged.mkdir()

    def write(self, config, layout: dict[str, torch.Tensor], parts: Iterable[dict[str, torch.Tensor]],
              extras: dict[str, torch.Tensor], tokenizer, source_cfg: Config) -> None:
        """`parts`: the weights (as _save_weights takes them), adding DiffLlama's sidecar tensors to `extras`."""
        _write_export(self.staged, config, layout, parts, extras, tokenizer, source_cfg)

    def discard(self) -> None:
        _remove(self.staged)
        if self.created and not any(self.directory.iterdir()):
            self.directory.rmdir()

    def publish(self) -> None:
        _move_in(self.staged, self.directory)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _is_export_file(name: str) -> bool:
    from transformers.utils.hub import CHAT_TEMPLATE_FILE

    return bool(WEIGHT_FILES.fullmatch(name)) or name in (SIDECAR_UNFOLDED, CHAT_TEMPLATE_FILE, *CODE_FILES)


def _move_in(staged: Path, directory: Path) -> None:
    """staged's files into directory in place of their namesakes, the earlier export's files this one lacks
    (more shards, a chat template, remote code) removed, and the files naming the others (the shards' index,
    then config.json) last. The earlier config.json goes first: every reader needs one (transformers, from-hf,
    chat --hf), so interrupted among these steps (a moment), the directory is refused until the next export
    replaces it and the staging directory's rest, never read as a mix of both exports (the earlier one's
    index naming its shards under the new config.json, or new weights under the earlier config.json)."""
    written = [path.name for path in staged.iterdir()]
    last = [name for name in (SAFETENSORS_INDEX, "config.json") if name in written]
    _remove(directory / "config.json")
    for name in [name for name in written if name not in last]:
        _replace(staged / name, directory / name)
    for stale in directory.iterdir():
        if _is_export_file(stale.name) and stale.name not in written and stale.is_file():
            stale.unlink()
    for name in last:
        _replace(staged / name, directory / name)
    staged.rmdir()


def _replace(source: Path, target: Path) -> None:
    if target.is_dir() and not target.is_symlink() or source.is_dir():
        _remove(target)  # a rename puts neither a file nor a directory over a directory, nor one over a file
    os.replace(source, target)


def _write_export(directory: Path, config, layout: dict[str, torch.Tensor], parts: Iterable[dict[str, torch.Tensor]],
                  extras: dict[str, torch.Tensor], tokenizer, source_cfg: Config) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config.save_pretrained(str(directory))
    if config.model_type != "megadiff":  # whose configuration code names them for 4.x itself
        name_rope_for_transformers4(directory, config)
    _generation_config(GenerationConfig.from_model_config(config), tokenizer, source_cfg).save_pretrained(
        str(directory))
    _save_weights(layout, parts, directory)  # before the sidecar: the parts fill `extras`
    tokenizer.save_hf(directory, source_cfg.model.seq_length)
    save_chat_template(source_cfg.data, tokenizer, directory)
    dump_config(source_cfg, directory / SIDECAR_CONFIG)
    if extras:
        save_file(_owned_copies(extras), str(directory / SIDECAR_UNFOLDED), metadata={"format": "pt"})
    if config.model_type == "megadiff":
        for name in CODE_FILES:
            shutil.copyfile(CODE_DIR / name, directory / name)


def _generation_config(generation, tokenizer, source_cfg: Config):
    """transformers' generate() stops at the EOS ids of the generation config: the tokenizer's (eos_ids: a Llama 3's
    several) and the exported chat template's end of turn (a chat-tuned model's reply ends there), where megadiff's
    generation and chat stop. It never draws the ids the tokenizer has no token for (tiktoken's gaps, reserved
    tokens in the export's tokenizer), as megadiff's generation never does. The padded vocabulary's rows stay
    drawable: tokens added to the tokenizer after the export take them, and must be generated (a chat fine-tune's end
    of turn); trained weights never favour them."""
    eos = list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else generation.eos_token_id
    generation.eos_token_id = stop_ids(eos, chat_template_of(source_cfg.data, tokenizer), tokenizer)
    generation.pad_token_id = tokenizer.pad
    generation.suppress_tokens = sorted(tokenizer.undecodable_ids) or None
    return generation


class HFWeights(Mapping[str, torch.Tensor]):
    """A model directory's tensors by name, each read from its file when asked for: a conversion holds
    one layer's at a time rather than the whole model's (26 GB for 13B in bf16) beside its own."""

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._sources: dict[str, object] = {}
        for file in files:
            try:
                source = safe_open(str(file), framework="pt") if file.suffix == ".safetensors" else \
                    _load_pytorch_file(file)
            except (OSError, RuntimeError, SafetensorError) as err:
                raise ConversionError(f"{file} cannot be read ({first_line(err)}): missing, or cut short by a "
                                      "download or copy?") from None
            self._sources.update(dict.fromkeys(source.keys(), source))

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self._sources[name]
        return source[name] if isinstance(source, dict) else source.get_tensor(name)

    def __contains__(self, name) -> bool:
        return name in self._sources  # without reading the tensor, as Mapping's would

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        """Without reading the tensor."""
        source = self._sources[name]
        return tuple(source[name].shape if isinstance(source, dict) else source.get_slice(name).get_shape())


def _load_pytorch_file(file: Path) -> dict[str, torch.Tensor]:
    """Memory-mapped (its tensors read as they are used), unless torch.save wrote it before torch 1.6,
    in a format that cannot be mapped: then read whole."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "_use_new_zipfile_serialization" not in str(err):
            raise
        return torch.load(file, map_location="cpu", weights_only=True)


@dataclass
class HFDirectory:
    path: Path
    config_dict: dict
    state: HFWeights
    extras: HFWeights | dict  # DiffLlama's sidecar, or nothing
    source_cfg: Config | None  # megadiff_config.yaml, when the directory is a megadiff export


def _weight_files(directory: Path) -> list[Path]:
    """transformers' weight files, in the order it looks for them after a safetensors index; the last, shards of
    pytorch_model.bin, are many a Llama 2 fine-tune's only weights."""
    for name in (SAFETENSORS_INDEX, "model.safetensors", "pytorch_model.bin", PYTORCH_INDEX):
        if not (directory / name).is_file():
            continue
        if name.endswith(".index.json"):
            return sorted({directory / shard for shard in _read_json(directory / name)["weight_map"].values()})
        return [directory / name]
    raise ConversionError(f"{directory}: no weights (model.safetensors, {SAFETENSORS_INDEX}, pytorch_model.bin or "
                          f"{PYTORCH_INDEX})")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path} is not JSON ({first_line(err)})") from None


def read_hf_dir(path: str | Path) -> HFDirectory:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConversionError(f"{directory} is not a Hugging Face model directory (no config.json)")
    extras_file = directory / SIDECAR_UNFOLDED
    config_file = directory / SIDECAR_CONFIG
    return HFDirectory(
        path=directory,
        config_dict=_read_json(directory / "config.json"),
        state=HFWeights(_weight_files(directory)),
        extras=HFWeights([extras_file]) if extras_file.is_file() else {},
        source_cfg=saved_config(read_saved_config(config_file)) if config_file.is_file() else None,
    )


def load_hf_model(directory: Path, model_type: str, dtype: torch.dtype = torch.float32):
    """The Hugging Face model of a directory; megadiff's own class for remote-code exports,
    so conversion never runs code found in a directory."""
    if model_type == "megadiff":
        from megadiff.convert.hf_code.modeling_megadiff import MegadiffForCausalLM as model_class
    else:
        from transformers import AutoModelForCausalLM as model_class
    return model_class.from_pretrained(str(directory), dtype=dtype).eval()
