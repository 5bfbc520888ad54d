"""A megadiff checkpoint as one module in one process, whatever TP/PP layout saved it.

`load_checkpoint(path)` builds the model with tensor/pipeline/context size 1 and lets
dist_checkpointing reshard the saved tensors into it. The returned `CausalLM` maps
input ids [B, N] to logits [B, N, V], V being the padded vocabulary (the Hugging Face
export's vocab_size).
"""
from __future__ import annotations

import random
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megadiff.checkpoint.format import (
    CheckpointError, checkpoint_config, checkpoint_tokenizer_spec, reading_checkpoint,
)
from megadiff.checkpoint.gather import model_sharded_tensors
from megadiff.checkpoint.safe_metadata import metadata_read_once
from megadiff.checkpoint.weights import damage_reported, load_model_weights
from megadiff.config import Config, ParallelConfig, padded_vocab_size
from megadiff.data.tokenizers import Tokenizer, load_tokenizer
from megadiff.models import build_model, to_transformer_config
from megadiff.models.documents import document_cu_seqlens, document_packing
from megadiff.models.kv_cache import KVCache
from megadiff.parallel import initialize

PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
# tokens whose logits a loss computation holds at once: V x 4096 fp32 is 1.6 GB for a 100K vocabulary
LOSS_CHUNK_TOKENS = 4096


def single_process_config(cfg: Config, precision: str | None = None) -> Config:
    """`cfg` for one process: no model parallelism, megatron's local layers, the same padded
    vocabulary as the layout that saved it (padding grows with the tensor-parallel size)."""
    model = cfg.model.model_copy(update={
        "make_vocab_size_divisible_by": cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor,
        "transformer_impl": "local", "attention_backend": "auto", "sdpa_kernels": None})
    precision = precision or cfg.train.precision
    train = cfg.train.model_copy(update={"precision": "bf16" if precision == "fp8" else precision})
    return cfg.model_copy(update={"model": model, "parallel": ParallelConfig(), "train": train})


@contextmanager
def _preserved_rng():
    """Building a model seeds and draws from the global generators; leave the caller's alone."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        # megatron's seeding also sets the current CUDA device's generator (on CPU, cpu_mode sends it to the
        # CPU one); a caller that has used CUDA has chosen its device, one that has not has no state to keep
        # (and querying would create a context on device 0 from every rank)
        cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda_in_use else []):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def build_single_process_model(cfg: Config, on_meta_device: bool = False):
    """An uninitialised TP1/PP1 GPTModel for `cfg` (already passed through single_process_config); on the meta
    device: its parameters' names, shapes and dtypes, and no memory."""
    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() > 1
            or parallel_state.get_pipeline_model_parallel_world_size() > 1):
        raise RuntimeError("a single-process model cannot be built where this process already runs model "
                           "parallelism")
    with _preserved_rng():
        initialize(ParallelConfig(), seed=cfg.train.seed)
        config = to_transformer_config(cfg)
        config.perform_initialization = False  # every weight is loaded next
        # megatron compiles its fused cross entropy for the shapes it meets: evaluation's vary (a shorter
        # last chunk and batch) and would recompile up to dynamo's limit, for no backward pass to save
        config.cross_entropy_loss_fusion = False
        # megatron's fused SwiGLU (CUDA) is torch.compile'd anew in every process and for each new shape:
        # every generate or evaluate command paid that compilation to save two elementwise passes
        config.bias_activation_fusion = False
        config.use_cpu_initialization |= on_meta_device  # megatron's layers then allocate on the default device
        with torch.device("meta") if on_meta_device else nullcontext():
            (model,) = build_model(cfg, config)
    return model.eval()


def check_checkpoint_tensors(model, checkpoint_dir: Path) -> None:
    """Refuse a checkpoint whose model tensors are missing, unknown or shaped differently from
    what its config.yaml describes, naming them (before dist_checkpointing's own errors)."""
    expected = {shard.key: tuple(shard.global_shape) for shard in model_sharded_tensors([model])}
    with damage_reported(checkpoint_dir), metadata_read_once(checkpoint_dir):
        metadata = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    saved = {key: tuple(meta.global_shape) for key, meta in metadata.items() if key.startswith(MODEL_KEY_PREFIXES)}
    problems = [f"missing tensor {key}" for key in sorted(set(expected) - set(saved))]
    problems += [f"unknown tensor {key} {saved[key]}" for key in sorted(set(saved) - set(expected))]
    problems += [f"tensor {key} has shape {saved[key]}, the config gives {expected[key]}"
                 for key in sorted(set(saved) & set(expected)) if saved[key] != expected[key]]
    if problems:
        raise CheckpointError(f"{checkpoint_dir} does not match its config.yaml:\n  " + "\n  ".join(problems))


def checkpoint_tokenizer(checkpoint_dir: Path, cfg: Config) -> Tokenizer:
    """Its own copy of its tokenizer (tokenizer/), else its data.tokenizer. One with more ids than the model
    has rows is another tokenizer than it was trained with (retrained or replaced at that path), whose ids
    beyond the embedding would fail at the first prompt that uses them."""
    spec = checkpoint_tokenizer_spec(checkpoint_dir, cfg)
    tokenizer = load_tokenizer(spec)
    rows = padded_vocab_size(cfg.model, cfg.parallel.tensor)
    if tokenizer.vocab_size > rows:
        raise CheckpointError(f"{checkpoint_dir}: its tokenizer {spec} has {tokenizer.vocab_size} ids, but the model "
                              f"embeds {rows} (model.vocab_size={cfg.model.vocab_size}, padded): it is not the "
                              "tokenizer the model was trained with (retrained or replaced at that path?)")
    return tokenizer


class OneTableRotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding keeping one table: the longest asked for (at least `window` positions), whose
    prefix answers every shorter request. megatron's forward is an lru_cache on the class (32 entries, held for
    the process's life): a table for each length asked, and inference asks for each KV cache's length and each
    batch's width; at 131072 positions (a converted Llama 3.1) a table is 64 MiB, up to 2 GiB of GPU memory kept.
    A position's row does not depend on the table's length, so the prefix holds the same values. One process
    only: there is no context-parallel rank to take a share of the table."""

    window: int
    one_table: torch.Tensor | None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        end = offset + max_seq_len
        if self.one_table is None or len(self.one_table) < end or self.one_table.device != self.inv_freq.device:
            self.one_table = None  # the old table goes before the longer one (or the moved model's) is made
            self.one_table = self.get_emb(max(end, self.window))
        return self.one_table[offset:end]


def keep_one_rotary_table(gpt, window: int) -> None:
    """`gpt`'s rotary embedding becomes a OneTableRotaryEmbedding sized for `window` positions."""
    rotary = gpt.rotary_pos_emb
    rotary.__class__ = OneTableRotaryEmbedding
    rotary.window, rotary.one_table = window, None


class CausalLM(torch.nn.Module):
    """model(input_ids [B, N]) -> logits [B, N, V] (batch first, V = padded vocabulary);
    model(input_ids, labels) -> next-token losses [B, N]; model.logits_at(input_ids, positions) -> [B, P, V].

    With labels, the output layer and cross entropy run over `loss_chunk_tokens` tokens at a time,
    so evaluating a 64K sequence holds a few thousand rows of logits, not 64K x V of them."""

    def __init__(self, gpt, cfg: Config, checkpoint_dir: Path | None = None,
                 loss_chunk_tokens: int = LOSS_CHUNK_TOKENS):
        """cfg: the checkpoint's own config (its training layout included)."""
        super().__init__()
        keep_one_rotary_table(gpt, cfg.model.seq_length)
        self.gpt = gpt
        self.cfg = cfg
        self.checkpoint_dir = checkpoint_dir
        self.loss_chunk_tokens = loss_chunk_tokens

    @property
    def vocab_size(self) -> int:
        return self.gpt.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        if self.checkpoint_dir is None:
            return load_tokenizer(self.cfg.data.tokenizer)
        return checkpoint_tokenizer(self.checkpoint_dir, self.cfg)

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """Host copies (conversion works in host memory, whatever device the model is on)."""
        return {name: param.detach().cpu() for name, param in self.gpt.named_parameters()}

    @property
    def device(self) -> torch.device:
        return next(self.gpt.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in: its weights' (DIFF's lambda vectors stay fp32 whatever it is)."""
        return self.gpt.embedding.word_embeddings.weight.dtype

    def new_cache(self, batch_size: int = 1, max_length: int | None = None, rewindable: bool = False) -> KVCache:
        """A KV cache for hidden_states(cache=) of at most `max_length` positions (default: the model's window),
        its buffers growing with the positions run; `rewindable`: see KVCache."""
        return KVCache(self.gpt, batch_size, max_length or self.cfg.model.seq_length, rewindable)

    def hidden_states(self, input_ids: torch.Tensor, document_eod: int | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """[N, B, H]: the decoder's output after its final norm, on the model's device; with
        `document_eod`, attention stays within the documents that token ends (data.document_masking).
        With `cache`, input_ids continue the positions it holds (and are added to them)."""
        if cache is not None and document_eod is not None:
            raise ValueError("a KV cache continues one sequence: it takes no document masking")
        batch, seq = input_ids.shape
        documents = None if document_eod is None else document_packing(
            document_cu_seqlens(input_ids.cpu(), document_eod), seq)
        input_ids = input_ids.to(self.device)
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + seq, device=self.device).expand(batch, seq)
        # megatron's last-pipeline-stage flag: without it GPTModel.forward returns before the output layer
        self.gpt.post_process = False
        try:
            if cache is None:
                return self.gpt(input_ids, positions, None, packed_seq_params=documents)
            with cache.extending(seq) as context:
                return self.gpt(input_ids, positions, None, inference_context=context, runtime_gather_output=True)
        finally:
            self.gpt.post_process = True

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, B, H] -> [n, B, V] through the output layer (the embedding's weight when tied)."""
        tied = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else None
        return self.gpt.output_layer(hidden, weight=tied)[0]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                document_eod: int | None = None) -> torch.Tensor:
        """Logits on the model's device, wherever `input_ids` are; with `labels` [B, N], megatron's
        per-token cross entropy [B, N] (fp32) instead. `document_eod`: as in hidden_states."""
        hidden = self.hidden_states(input_ids, document_eod)
        if labels is None:
            return self.output_logits(hidden).transpose(0, 1).contiguous()
        labels = labels.to(self.device)
        step = max(1, self.loss_chunk_tokens // labels.shape[0])
        return torch.cat([self.gpt.compute_language_model_loss(labels[:, i:i + step],
                                                               self.output_logits(hidden[i:i + step]))
                          for i in range(0, labels.shape[1], step)], dim=1)

    def logits_at(self, input_ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """[B, len(positions), V]: the logits of those positions only (a 64K sequence's full logits
        would take 26 GB in fp32 for a 100K vocabulary)."""
        return self.output_logits(self.hidden_states(input_ids)[positions]).transpose(0, 1)

    def next_token_logits(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """[B, V]: the logits of the last position only (generation needs no others); with `cache`,
        input_ids continue the positions it holds."""
        return self.output_logits(self.hidden_states(input_ids, cache=cache)[-1:])[0]


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> CausalLM:
    """A run's output_dir, its checkpoints/ directory (latest) or an iter_* directory -> CausalLM.

    dtype: the weights' dtype (default: the checkpoint's training precision). The model sits where
    megatron computes (megadiff.parallel.compute_device): the current CUDA device when one is
    visible, since megatron-core's RoPE moves there whatever the weights' device, else the CPU."""
    if dtype is not None and dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {list(PRECISIONS)}, got {dtype}")
    with reading_checkpoint(path) as checkpoint_dir:
        saved_cfg = checkpoint_config(checkpoint_dir)
        checkpoint_tokenizer(checkpoint_dir, saved_cfg)  # its refusals before the minutes of reading the weights
        model = build_single_process_model(single_process_config(saved_cfg, PRECISIONS.get(dtype)))
        with damage_reported(checkpoint_dir), metadata_read_once(checkpoint_dir):  # for the check and the load
            check_checkpoint_tensors(model, checkpoint_dir)
            load_model_weights([model], checkpoint_dir)
    return CausalLM(model, saved_cfg, checkpoint_dir)
