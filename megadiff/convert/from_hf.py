"""`megadiff convert from-hf`: a Hugging Face directory -> a megadiff checkpoint.

Reads megadiff's own exports (Llama, DiffLlama, MegadiffForCausalLM) back into
identical tensors, and any stock LlamaForCausalLM into a softmax checkpoint for
continued pre-training (its config derived from config.json). The checkpoint
directory (for `--load` and `checkpoint.load`) holds config.yaml, the weights in
megatron's dist-checkpoint format (loadable into any layout) and, unless the model
uses a packaged tiktoken encoding, its tokenizer under tokenizer/ (where
`data.tokenizer` points).
"""
from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from rich.console import Console
from torch.distributed.checkpoint.api import CheckpointException

from megadiff.checkpoint.format import TOKENIZER_DIR
from megadiff.checkpoint.single_process import (
    PRECISIONS, CausalLM, build_single_process_model, single_process_config,
)
from megadiff.checkpoint.weights import save_model_weights, write_failure
from megadiff.config import Config, ModelConfig, padded_vocab_size, validate_config
from megadiff.console import plain_console
from megadiff.convert.check import compare_logits, hf_logits, megadiff_logits, thresholds_for
from megadiff.convert.hf_config import load_hf_config, model_fields_from_hf, same_model, vocab_padding_multiple
from megadiff.convert.hf_io import HFDirectory, load_hf_model, read_hf_dir
from megadiff.convert.hf_layout import ConversionError, Dims, check_tensors, expected_hf_shapes, hf_to_megatron
from megadiff.convert.steps import step, writing_alone
from megadiff.data.tokenizers import (
    GENERATION_CONFIG, PACKAGED_TIKTOKEN, HFTokenizer, TokenizerError, load_tokenizer, why_unreadable,
)
from megadiff.files import publish_staged, raise_if_a_file_is_in_the_way, staging_dir
from megadiff.models.transformer_config import PRECISION_DTYPES

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
VOCAB_PARAMETERS = {"embedding.word_embeddings.weight", "output_layer.weight"}  # megatron's names of their rows

def _megadiff_config(hf_dir: HFDirectory, fields: dict, vocab_size: int, precision: str, tokenizer: str,
                     console: Console, pad_vocab: int | None) -> Config:
    """The sidecar config of a megadiff export where it still describes config.json, else one derived from it;
    the vocabulary's `vocab_size` rows padded to a multiple of `pad_vocab`, or kept as they are."""
    rows = -(-vocab_size // pad_vocab) * pad_vocab if pad_vocab else vocab_size
    source = hf_dir.source_cfg
    if source is not None and same_model(source.model, fields) and \
            padded_vocab_size(source.model, source.parallel.tensor) == vocab_size:
        base, model = source, source.model
        if rows != vocab_size:  # the run's own vocabulary (its tokenizer's), padded further
            tensor = source.parallel.tensor
            if rows % tensor:
                raise ConversionError(f"--pad-vocab {pad_vocab} gives {rows} rows, which the export's "
                                      f"parallel.tensor={tensor} does not divide: pass a multiple of {tensor}")
            model = model.model_copy(update={"make_vocab_size_divisible_by": rows // tensor})
    else:
        if source is not None:
            console.print("megadiff convert: megadiff_config.yaml does not describe config.json (edited since the "
                          "export?); deriving the model config from config.json")
        base = Config()
        model = ModelConfig(**fields, vocab_size=vocab_size,
                            make_vocab_size_divisible_by=pad_vocab or vocab_padding_multiple(vocab_size))
    # not the exported run's output_dir or initial checkpoint: trained from without output_dir=, the
    # converted checkpoint resumed (and wrote into) that run instead of loading the converted weights
    cfg = base.model_copy(update={"model": model, "output_dir": Config().output_dir,
                                  "checkpoint": base.checkpoint.model_copy(update={"load": None}),
                                  "data": base.data.model_copy(update={"tokenizer": tokenizer}),
                                  "train": base.train.model_copy(update={"precision": precision})})
    validate_config(cfg)
    return cfg


def _load_parts(model, parts: Iterable[dict[str, torch.Tensor]]) -> int:
    """Copies each part's tensors into the model's parameters of their names, emptying the part (so
    that no reference outlives the copy); returns how many numbers it copied."""
    own, copied = dict(model.named_parameters()), 0
    with torch.no_grad():
        for part in parts:
            while part:
                name, tensor = part.popitem()
                parameter = own.pop(name)
                parameter.copy_(tensor)
                _refuse_overflow(name, tensor, parameter)
                copied += tensor.numel()
                del tensor
    if own:
        raise ConversionError(f"no tensor converted for {', '.join(sorted(own))}")
    return copied


def _read_weights(model, hf_dir: HFDirectory, dims: Dims, rows: int) -> int:
    """The directory's weights copied into the model, a layer at a time; returns how many numbers it copied."""
    return _load_parts(model, _with_padded_vocab(hf_to_megatron(hf_dir.state, dims, hf_dir.extras), rows))


def _refuse_overflow(name: str, value: torch.Tensor, stored: torch.Tensor) -> None:
    if not stored.isfinite().all() and value.isfinite().all():
        raise ConversionError(f"{name}: values up to {float(value.abs().max()):.4g} overflow {stored.dtype} (whose "
                              f"largest is {torch.finfo(stored.dtype).max:.4g}): convert with --dtype bf16 or fp32")


def _checkpoint_dtypes(cfg: Config) -> dict[str, torch.dtype]:
    """Each parameter's dtype in the checkpoint's model (lambda's vectors stay fp32), that model built on the meta
    device: no memory."""
    model = build_single_process_model(single_process_config(cfg), on_meta_device=True)
    return {name: parameter.dtype for name, parameter in model.named_parameters()}


def _round_as_the_checkpoint(checked, dtypes: dict[str, torch.dtype]) -> None:
    """The fp32 model's weights rounded, a parameter at a time, to what the checkpoint will hold, so that the check
    runs on those (rounding them through a model in the checkpoint's dtype held it beside the fp32 one: 6 bytes a
    parameter in bf16, 420 GB for a Llama 70B)."""
    with torch.no_grad():
        for name, parameter in checked.named_parameters():
            rounded = parameter.to(dtypes[name])
            _refuse_overflow(name, parameter, rounded)
            parameter.copy_(rounded)


def _with_padded_vocab(parts: Iterable[dict[str, torch.Tensor]], rows: int) -> Iterator[dict[str, torch.Tensor]]:
    """The parts, the embedding's and output layer's rows padded to `rows` with their mean (as transformers'
    resize_token_embeddings starts new rows: near the others, so no logit of a padded id stands out)."""
    for part in parts:
        for name in VOCAB_PARAMETERS & part.keys():
            matrix = part[name]
            if matrix.shape[0] == rows:
                continue  # not copied: a vocabulary's matrices are the largest
            mean = matrix.float().mean(0, keepdim=True).to(matrix.dtype)
            part[name] = torch.cat([matrix, mean.expand(rows - matrix.shape[0], -1)])
        yield part


def _is_weight(name: str, tied_embeddings: bool) -> bool:
    """transformers before 4.31 saved RoPE's frequencies with each layer (they follow from config.json),
    and some tied checkpoints store the shared matrix twice."""
    return not (name.endswith(".rotary_emb.inv_freq") or (tied_embeddings and name == LM_HEAD))


def _tokenizer(hf_dir: HFDirectory, save: Path, hf_config):
    """(data.tokenizer value, number of ids in use, HF tokenizer to copy under tokenizer/ or None).

    A packaged tiktoken encoding named by the export's sidecar stays by name, unless the directory's tokenizer
    has other ids now (tokens added for fine-tuning: the encoding would read them as text)."""
    from transformers import AutoTokenizer

    source = hf_dir.source_cfg
    packaged = load_tokenizer(source.data.tokenizer) if source and source.data.tokenizer in PACKAGED_TIKTOKEN else None
    try:  # never run code from the directory: the tokenizer files alone describe the tokenizer
        # with the config read already: transformers' own reading of a megadiff export's config.json (model_type
        # megadiff, code it will not run) warned that the tokenizer "can yield errors"
        hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir.path), trust_remote_code=False, config=hf_config)
    except (OSError, ValueError) as err:
        if packaged is not None:
            return source.data.tokenizer, packaged.vocab_size, None
        raise ConversionError(f"{hf_dir.path}: no usable tokenizer files ({why_unreadable(hf_dir.path, err)}); a "
                              "megadiff checkpoint carries its tokenizer: save the model's tokenizer there") from None
    if packaged is not None and len(hf_tokenizer) == packaged.vocab_size:
        return source.data.tokenizer, packaged.vocab_size, None
    _refuse_what_megadiff_cannot_read(hf_dir.path, hf_tokenizer, hf_config.eos_token_id)
    return str((save / TOKENIZER_DIR).resolve()), len(hf_tokenizer), hf_tokenizer


def _save_tokenizer(hf_tokenizer, source: Path, hf_config, directory: Path) -> None:
    """The tokenizer's files, with the model's generation config, whose EOS ids generation stops at (a Llama 3
    Instruct's <|end_of_text|> beside its tokenizer's <|eot_id|>: generation_eos_ids): its generation_config.json,
    else the one transformers derives from config.json (older Llama 3 directories list the EOS ids there alone)."""
    from transformers import GenerationConfig

    hf_tokenizer.save_pretrained(str(directory))
    if (source / GENERATION_CONFIG).is_file():
        shutil.copyfile(source / GENERATION_CONFIG, directory / GENERATION_CONFIG)
    else:
        GenerationConfig.from_model_config(hf_config).save_pretrained(str(directory))


def _refuse_what_megadiff_cannot_read(directory: Path, hf_tokenizer, eos_token_id) -> None:
    """The tokenizer read as the checkpoint's readers will read it (pre-training, generate, load_checkpoint): one
    naming no EOS (many name it in config.json alone) was converted into a checkpoint that each of them refused."""
    try:
        HFTokenizer(str(directory), hf_tokenizer)
    except TokenizerError as err:
        raise ConversionError(f"{err}: a megadiff checkpoint ends its documents with its tokenizer's EOS; name it "
                              f"(eos_token in {directory}/tokenizer_config.json; config.json's eos_token_id is "
                              f"{eos_token_id})") from None


def _refuse_ids_without_rows(directory: Path, ids: int, vocab_size: int, rows: int) -> None:
    """A tokenizer with more ids than the model has rows (tokens added without resize_token_embeddings): the
    conversion wrote a checkpoint that every loader then refused as having another model's tokenizer."""
    if ids > rows:
        raise ConversionError(f"{directory}: its tokenizer has {ids:,} ids, but the model embeds {vocab_size:,} "
                              f"(config.json vocab_size), so ids {vocab_size:,} and up have no row: pad the rows "
                              "(--pad-vocab N pads them to a multiple of N, the new rows the mean of the others) or "
                              "resize the embeddings in transformers first")


def convert_from_hf(load: str | Path, save: str | Path, dtype: str | None = None, check: bool = True,
                    pad_vocab: int | None = None) -> Path:
    """`pad_vocab`: pad the vocabulary's rows to a multiple of it (e.g. 128: an odd vocabulary, a Llama's
    32,001, trains at parallel.tensor=1 only), the new rows the old ones' mean."""
    if pad_vocab is not None and pad_vocab < 1:
        raise ConversionError(f"--pad-vocab must be >= 1, not {pad_vocab}")
    out = Path(save)
    raise_if_a_file_is_in_the_way(out, lambda text: ConversionError(f"{text}; from-hf writes a new checkpoint "
                                                                    "directory"))
    with writing_alone(out):
        return _convert(load, out, dtype, check, pad_vocab)


def _convert(load: str | Path, out: Path, dtype: str | None, check: bool, pad_vocab: int | None) -> Path:
    console = plain_console()
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{out} is not empty; from-hf writes a new checkpoint directory")
    hf_dir = read_hf_dir(load)
    hf_config = load_hf_config(hf_dir.config_dict, hf_dir.path)
    family = hf_config.model_type
    state = hf_dir.state
    if EMBEDDING not in state:
        raise ConversionError(f"{hf_dir.path}: no tensor {EMBEDDING} (a causal LM's); a model saved without its "
                              f"head (LlamaModel, not LlamaForCausalLM) names it without 'model.'. Tensors there: "
                              f"{', '.join(sorted(state)[:4])}, ...")
    if hf_config.tie_word_embeddings and LM_HEAD in state and not torch.equal(state[LM_HEAD], state[EMBEDDING]):
        raise ConversionError(f"{hf_dir.path}: config.json ties the embeddings (tie_word_embeddings), but its "
                              f"{LM_HEAD} differs from {EMBEDDING}, and transformers then uses the separate head. "
                              "Set tie_word_embeddings to false in config.json to convert it as the model it is")
    hf_dtype = state[EMBEDDING].dtype
    if dtype is None and hf_dtype not in PRECISIONS:
        raise ConversionError(f"{hf_dir.path}: weights in {hf_dtype}; pass --dtype fp32, bf16 or fp16")
    precision = dtype or PRECISIONS[hf_dtype]
    tokenizer_spec, vocab_in_use, hf_tokenizer = _tokenizer(hf_dir, out, hf_config)
    cfg = _megadiff_config(hf_dir, model_fields_from_hf(hf_config, hf_dir.path), hf_config.vocab_size, precision,
                           tokenizer_spec, console, pad_vocab)
    rows = padded_vocab_size(cfg.model, cfg.parallel.tensor)
    _refuse_ids_without_rows(hf_dir.path, vocab_in_use, hf_config.vocab_size, rows)
    dims = Dims.of(cfg.model, family)
    # the check's model holds the read tensors in fp32 (exactly: the checkpoint's may round them, --dtype)
    checked = build_single_process_model(single_process_config(cfg, "fp32" if check else None))
    expected = expected_hf_shapes(dict(checked.named_parameters()), dims)
    for name in {EMBEDDING, LM_HEAD} & expected.keys():  # before padding
        expected[name] = torch.Size([hf_config.vocab_size, *expected[name][1:]])
    check_tensors({name: state.shape(name) for name in state if _is_weight(name, hf_config.tie_word_embeddings)},
                  expected, f"{hf_dir.path} (config.json)")
    with step(console, f"reading {load}"):
        parameters = _read_weights(checked, hf_dir, dims, rows)
    if rows > hf_config.vocab_size:
        console.print(f"megadiff convert: the vocabulary padded from {hf_config.vocab_size:,} to {rows:,} rows "
                      "(--pad-vocab), the new rows the mean of the old")
    if not check:
        model = checked
    else:  # before anything is written, holding one fp32 model at a time and nothing else as large
        rounded_to = hf_dtype
        if precision != "fp32":  # the check runs (in fp32) on the weights the checkpoint holds, --dtype's rounding
            _round_as_the_checkpoint(checked, _checkpoint_dtypes(cfg))
            rounded_to = PRECISION_DTYPES[precision]
        with step(console, "checking the checkpoint's logits against the Hugging Face model's"):
            embedded = min(vocab_in_use, hf_config.vocab_size)  # the ids both models have rows for
            ours = megadiff_logits(CausalLM(checked, cfg), embedded)[..., :hf_config.vocab_size]  # not the padding
            del checked  # before the Hugging Face model is loaded
            theirs = hf_logits(load_hf_model(hf_dir.path, family), embedded)
            result = compare_logits(ours, theirs, thresholds_for(family, hf_dtype, rounded_to))
        console.print(f"megadiff convert: check passed: {result.summary()}")
        # read again into the checkpoint's model: built beside the check's, it was a second model in memory; each
        # weight is rounded once from the same tensors, so it holds what the check ran on
        model = build_single_process_model(single_process_config(cfg))
        with step(console, f"reading {load} into the checkpoint's model"):
            _read_weights(model, hf_dir, dims, rows)
    # written aside and named when whole: killed before its tokenizer, it loaded, naming a tokenizer it lacked
    staged = staging_dir(out)
    shutil.rmtree(staged, ignore_errors=True)  # a killed conversion's
    try:
        with step(console, f"writing {parameters:,} parameters to {out}"):
            save_model_weights([model], cfg, staged)
        if hf_tokenizer is not None:
            _save_tokenizer(hf_tokenizer, hf_dir.path, hf_config, staged / TOKENIZER_DIR)
    except (CheckpointException, OSError) as error:  # a full disk, a quota: its space given back
        shutil.rmtree(staged, ignore_errors=True)
        raise ConversionError(f"{out} could not be written ({write_failure(error)})") from error
    publish_staged(out)
    console.print(f"megadiff convert: {hf_dir.path} ({family}) -> {out} (megadiff {cfg.model.variant}, "
                  f"{cfg.train.precision})")
    return out
