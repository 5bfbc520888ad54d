"""`megadiff convert to-hf`: a megadiff checkpoint (any TP/PP layout) -> a complete Hugging Face directory.

softmax -> LlamaForCausalLM, DIFF -> DiffLlamaForCausalLM (both stock transformers),
Shared DIFF, DINT (and DIFF with --remote-code) -> MegadiffForCausalLM, whose code is
copied into the directory (trust_remote_code=True). The tokenizer goes along.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megadiff.checkpoint.format import CHECKPOINTS_DIR, checkpoint_config, reading_checkpoint
from megadiff.checkpoint.single_process import checkpoint_tokenizer, load_checkpoint, single_process_config
from megadiff.config import padded_vocab_size
from megadiff.console import plain_console
from megadiff.convert.check import compare_logits, hf_logits, megadiff_logits, thresholds_for
from megadiff.convert.hf_config import build_hf_config, choose_family
from megadiff.convert.hf_io import StagedExport, load_hf_model
from megadiff.convert.hf_layout import ConversionError, Dims, megatron_to_hf, megatron_to_hf_parts
from megadiff.convert.steps import step, writing_alone
from megadiff.files import raise_if_a_file_is_in_the_way
from megadiff.models.transformer_config import PRECISION_DTYPES

# lambda's vectors are exported in fp32 whatever --dtype (exp of their dot products is sensitive)
FP32_SUFFIXES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


class CastWeights(Mapping[str, torch.Tensor]):
    """`state`'s tensors in `dtype` (lambda's vectors as they are), each cast as it is read: the export converts
    a layer at a time, and all of them cast at once were a second model beside the source."""

    def __init__(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self.state, self.dtype = state, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.state[name]
        return tensor if name.endswith(FP32_SUFFIXES) else tensor.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _on_the_meta_device(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.empty_like(tensor, device="meta") for name, tensor in state.items()}


def convert_to_hf(load: str | Path, save: str | Path, dtype: str | None = None, check: bool = True,
                  remote_code: bool = False) -> Path:
    out = Path(save)
    # a link to nothing is no directory either
    raise_if_a_file_is_in_the_way(out, lambda text: ConversionError(f"--save {text}; to-hf writes a directory"))
    with writing_alone(out), reading_checkpoint(load) as checkpoint_dir:
        return _export(checkpoint_dir, out, dtype, check, remote_code)


def _export(checkpoint_dir: Path, out: Path, dtype: str | None, check: bool, remote_code: bool) -> Path:
    console = plain_console()
    if (out / "metadata.json").is_file() or (out / CHECKPOINTS_DIR).is_dir():
        # its weights and config.json among the training files, the directory then read as an HF model too
        raise ConversionError(f"--save {out} holds a megadiff run or checkpoint: give the export a directory of "
                              "its own (e.g. hf/NAME)")
    cfg = checkpoint_config(checkpoint_dir)
    family = choose_family(cfg.model, remote_code)  # refusals come before any weight is read
    if remote_code and family == "llama":
        console.print("megadiff convert: --remote-code: a softmax model exports as the stock LlamaForCausalLM, "
                      "with no code of its own")
    if cfg.data.document_masking:
        console.print("megadiff convert: the run trained with data.document_masking, attending within each document; "
                      "transformers attends across the documents of a sequence: give the export one document a "
                      "sequence (as a prompt is) for the run's logits")
    tokenizer = checkpoint_tokenizer(checkpoint_dir, cfg)
    vocab_size = padded_vocab_size(cfg.model, cfg.parallel.tensor)
    source_dtype = PRECISION_DTYPES[single_process_config(cfg).train.precision]  # what load_checkpoint builds
    target_dtype = PRECISION_DTYPES[dtype] if dtype else source_dtype
    hf_config = build_hf_config(cfg.model, family, vocab_size, tokenizer.bos, tokenizer.eod, target_dtype)
    with step(console, f"reading {checkpoint_dir}"):
        source = load_checkpoint(checkpoint_dir)
    export = StagedExport(out)
    try:
        _write(export, source, Dims.of(cfg.model, family), target_dtype, hf_config, tokenizer, cfg, console)
        if check:  # before the export replaces an earlier one: failing, it leaves that as it was
            with step(console, "checking the export's logits against the checkpoint's"):
                if source_dtype != torch.float32:
                    del source  # free its (GPU) memory before the check's fp32 copy is loaded
                    source = load_checkpoint(checkpoint_dir, dtype=torch.float32)
                ours = megadiff_logits(source, tokenizer.vocab_size)
                del source  # before the Hugging Face model is loaded
                theirs = hf_logits(load_hf_model(export.staged, hf_config.model_type), tokenizer.vocab_size)
                result = compare_logits(ours, theirs, thresholds_for(family, source_dtype, target_dtype))
            console.print(f"megadiff convert: check passed: {result.summary()}")
    except BaseException:
        export.discard()
        raise
    export.publish()
    console.print(f"megadiff convert: {checkpoint_dir} ({cfg.model.variant}) -> {out} "
                  f"({hf_config.architectures[0]}, {str(target_dtype).removeprefix('torch.')})")
    return out


def _write(export: StagedExport, source, dims: Dims, dtype: torch.dtype, hf_config, tokenizer, cfg, console) -> None:
    """The export's files, its weights converted a layer at a time as its shards are written. What it holds goes
    with it: the source's host weights (copies of a GPU model's) and the sidecar's views or casts of them would
    hold another model (26 GB for 13B in bf16) beside the check's fp32 ones."""
    weights, extras = source.parameters_by_name(), {}
    # cast before DiffLlama's head-norm fold: from-hf refolds the sidecar's tensors to recognise o_proj
    layout = megatron_to_hf(CastWeights(_on_the_meta_device(weights), dtype), dims)[0]
    with step(console, f"writing {sum(t.numel() for t in layout.values()):,} parameters to {export.directory}"):
        export.write(hf_config, layout, megatron_to_hf_parts(CastWeights(weights, dtype), dims, extras), extras,
                     tokenizer, cfg)
