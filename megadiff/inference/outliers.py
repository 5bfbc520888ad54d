"""`megadiff outliers`: the DIFF paper's activation-outlier statistics (its Table 5) of a checkpoint.

Over held-out samples (as `megadiff evaluate` reads them), the largest absolute values (top 1,
2, 3, 10, 100) and the median absolute value of
- attention logits: every softmax map's pre-softmax scores q.k x scale over the (query, key) pairs
  the model attends: causal ones, within documents for a checkpoint trained with
  data.document_masking (which runs so here), within a Hugging Face model's sliding window; a
  differential head has two maps;
- hidden states: every layer's output.
A Hugging Face model (`--hf`) is read through transformers' attention interface and layer hooks.
Top values are exact. The median comes from a histogram of log-spaced bins (each 0.16% wide), as
billions of values cannot be sorted; it is exact to that width. Compare a DIFF run with its
softmax twin: the paper reports about 8x smaller top attention logits and 2x smaller top hidden
states for DIFF.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Iterable, Iterator

import torch
from rich.table import Table

from megadiff.checkpoint.single_process import CausalLM
from megadiff.data.datasets import source_config
from megadiff.data.locations import training_blend
from megadiff.data.prepare import ensure_prepared
from megadiff.inference.evaluate import (
    check_before_loading, check_request, evaluation_config, held_out_dataset, sample_batches,
)
from megadiff.inference.generate import document_eod
from megadiff.inference.hf_attention import attention_calls, refuse_megadiff_modeling_code, require_every_layer
from megadiff.inference.hf_model import HFCausalLM, load_model
from megadiff.inference.progress import ProgressTask, command_progress
from megadiff.inference.ranks import gather_across_ranks, share, share_size, sum_across_ranks
from megadiff.inference.reporting import command_console, write_report
from megadiff.models.differential_attention import DifferentialCoreAttention
from megadiff.ops.common import map_pairs

TOP = (1, 2, 3, 10, 100)
HISTOGRAM_RANGE = (1e-8, 1e8)  # |values| below the range count as its lowest bin, above as its highest
HISTOGRAM_BINS = 23_000  # log-spaced: each bin 0.16% wide
# attention scores formed at once (512 MB in fp32), whatever the batch, heads and length: a fixed
# number of query rows would form 256 x 64K scores per head, some 10 GB with the copies taken of them
SCORE_VALUES = 1 << 27
HISTOGRAM_VALUES = 1 << 24  # values binned at once: each takes 16 bytes more while it is (fp64 and its bin)


class AbsStatistics:
    """The largest |x| and a histogram of every |x|, over tensors seen one after another."""

    def __init__(self, largest: int = max(TOP)):
        self.largest = largest
        self.top = torch.empty(0)
        self.counts: torch.Tensor | None = None
        self.edges: torch.Tensor | None = None
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        values = values.detach().float().abs().flatten()
        if values.numel() == 0:
            return
        self._histogram_on(values.device)
        self._keep_largest(torch.topk(values, min(self.largest, values.numel())).values)
        for piece in values.split(HISTOGRAM_VALUES):
            self.counts += torch.bincount(torch.bucketize(piece.double(), self.edges), minlength=self.counts.numel())
        self.count += values.numel()

    def combine_ranks(self) -> None:
        """Take in every other rank's values too (each rank saw its share of the samples)."""
        self._histogram_on(self.top.device)
        self.counts = sum_across_ranks(self.counts)
        self.count = int(sum_across_ranks(torch.tensor([self.count], dtype=torch.int64)).item())
        # the same number of values from every rank; -1 fills a short top (|x| >= 0)
        padded = torch.cat([self.top, self.top.new_full((self.largest - self.top.numel(),), -1.0)])
        everyone = gather_across_ranks(padded)
        self.top = torch.empty(0, device=self.top.device)
        self._keep_largest(everyone[everyone >= 0])

    def _histogram_on(self, device: torch.device) -> None:
        if self.edges is None:
            low, high = (math.log10(x) for x in HISTOGRAM_RANGE)
            self.edges = torch.logspace(low, high, HISTOGRAM_BINS + 1, dtype=torch.float64).to(device)
            self.counts = torch.zeros(HISTOGRAM_BINS + 2, dtype=torch.int64, device=device)

    def _keep_largest(self, values: torch.Tensor) -> None:
        candidates = torch.cat([self.top.to(values.device), values])
        self.top = torch.topk(candidates, min(self.largest, candidates.numel())).values

    def median(self) -> float:
        """The middle |x|, to a bin's width: the geometric centre of the bin holding it."""
        bin_index = int(torch.searchsorted(self.counts.cumsum(0), (self.count + 1) // 2))
        edges = self.edges.cpu().tolist()
        if bin_index == 0:
            return 0.0 if edges[0] == 0 else edges[0]
        if bin_index > HISTOGRAM_BINS:
            return edges[-1]
        return math.sqrt(edges[bin_index - 1] * edges[bin_index])

    def summary(self) -> dict:
        top = self.top.cpu().tolist()
        return {**{f"top_{k}": top[k - 1] for k in TOP if k <= len(top)}, "median": self.median(),
                "values": self.count}


def softmax_scale(core_attention: torch.nn.Module, query: torch.Tensor) -> float:
    """The layer's scale of q.k: its own, else 1/sqrt(d) as every attention backend defaults."""
    return core_attention.softmax_scale or query.shape[-1] ** -0.5


def attention_maps(core_attention: torch.nn.Module, query: torch.Tensor, key: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, k) [b, heads, s, d] of each softmax map, keys repeated for grouped queries, from the core
    attention's inputs [s, b, megatron heads, d]: adjacent megatron heads are a differential head's
    two maps, for queries and keys alike."""
    if isinstance(core_attention, DifferentialCoreAttention):
        (q1, q2), (k1, k2) = map_pairs(query), map_pairs(key)
        pairs = [(q1, k1), (q2, k2)]
    else:
        pairs = [(query, key)]
    return [(q.permute(1, 2, 0, 3), k.repeat_interleave(q.shape[2] // k.shape[2], dim=2).permute(1, 2, 0, 3))
            for q, k in pairs]


def causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float, values: int = SCORE_VALUES,
                  attends: Callable[[slice], torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
    """q.k x scale of every (query i, key j <= i) pair (flattened), of as many query positions at a
    time as keep the scores formed at once within `values` (one position at least); with `attends`
    (query rows -> [b, rows, keys] booleans), of the pairs it allows alone (the model's documents or
    sliding window: it forms no other scores)."""
    batch, heads, seq = q.shape[:3]
    rows = max(1, values // (batch * heads * seq))
    keys = torch.arange(seq, device=q.device)
    k_t = k.float().transpose(-1, -2)  # once, not again for every block of rows
    for start in range(0, seq, rows):
        scores = q[:, :, start:start + rows].float() @ k_t * scale  # [b, h, r, s]
        visible = keys[None, :] <= torch.arange(start, start + scores.shape[2], device=q.device)[:, None]
        if attends is None:
            yield scores[:, :, visible]
        else:
            yield scores.permute(0, 2, 3, 1)[visible & attends(slice(start, start + scores.shape[2]))]


class Recorder:
    """The two statistics, and the hooks that feed them (removed by close()); run(tokens) runs the
    model over a batch."""

    def __init__(self):
        self.logits, self.hidden = AbsStatistics(), AbsStatistics()
        self._handles = []

    def _layer_output(self, module, args, output) -> None:
        self.hidden.add(output[0] if isinstance(output, tuple) else output)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class ActivationRecorder(Recorder):
    """Forward hooks on every layer of a single-process GPTModel; a checkpoint trained with
    data.document_masking runs (and is measured) within its documents, as it was trained."""

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        self.document_eod = document_eod(model)
        self._documents: torch.Tensor | None = None  # [b, N]: the document of each position of the batch run
        for layer in model.gpt.decoder.layers:
            self._handles.append(layer.self_attention.core_attention.register_forward_pre_hook(self._attention))
            self._handles.append(layer.register_forward_hook(self._layer_output))

    def run(self, tokens: torch.Tensor) -> None:
        if self.document_eod is not None:
            ends = (tokens == self.document_eod).long()
            self._documents = (ends.cumsum(1) - ends).to(self.model.device)  # a document ends with its EOD
        self.model.hidden_states(tokens, self.document_eod)

    def _same_document(self, rows: slice) -> torch.Tensor:
        return self._documents[:, rows, None] == self._documents[:, None, :]

    def _attention(self, module, args) -> None:
        query, key = args[0], args[1]
        scale = softmax_scale(module, query)
        attends = None if self._documents is None else self._same_document
        for q, k in attention_maps(module, query, key):
            for scores in causal_scores(q, k, scale, attends=attends):
                self.logits.add(scores)


class HFActivationRecorder(Recorder):
    """The same statistics of a transformers model (`outliers --hf`): its attention calls' scores
    through transformers' attention interface (each map once: DiffLlama's second call repeats its
    queries and keys with the other half of V), its decoder layers' outputs by forward hooks."""

    def __init__(self, model: HFCausalLM):
        super().__init__()
        self.hf = model.hf
        # each layer's last queries and keys, weakly: held, they were 54 GB for a 13B model at 64K tokens
        self.last_maps: dict[torch.nn.Module, tuple[weakref.ref, weakref.ref]] = {}
        self._handles = [layer.register_forward_hook(self._layer_output) for layer in self.hf.get_decoder().layers]

    def _attention(self, module, query, key, value, scaling, mask) -> None:
        last = self.last_maps.get(module)
        self.last_maps[module] = (weakref.ref(query), weakref.ref(key))
        if last is not None and last[0]() is query and last[1]() is key:
            return
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        attends = None if mask is None else lambda rows: mask[:, 0, rows].expand(query.shape[0], -1, -1)
        for scores in causal_scores(query, key, scaling, attends=attends):
            self.logits.add(scores)

    def run(self, tokens: torch.Tensor) -> None:
        self.last_maps.clear()
        with attention_calls(self.hf, self._attention):
            self.hf(input_ids=tokens.to(next(self.hf.parameters()).device), use_cache=False, logits_to_keep=1)
        require_every_layer(self.hf, len(self.last_maps), "outliers")


@torch.no_grad()
def record_activations(model: CausalLM | HFCausalLM, batches: Iterable[torch.Tensor],
                       on_batch: Callable[[torch.Tensor], None] | None = None) -> dict:
    """{"attention_logits": ..., "hidden_states": ...} over the token batches [b, N] (of every rank:
    each passes its own, calling `on_batch` after each)."""
    recorder = (HFActivationRecorder if isinstance(model, HFCausalLM) else ActivationRecorder)(model)
    try:
        for tokens in batches:
            recorder.run(tokens)
            if on_batch is not None:
                on_batch(tokens)
    finally:
        recorder.close()
    recorder.logits.combine_ranks()
    recorder.hidden.combine_ranks()
    return {"attention_logits": recorder.logits.summary(), "hidden_states": recorder.hidden.summary()}


def outliers(load: str | None, split: str = "valid", seq_length: int | None = None, sequences: int = 16,
             batch_size: int = 1, overrides: Iterable[str] = (), output: str | None = None, hf: str | None = None,
             dtype: str | None = None, window: int | None = None) -> int:
    """`megadiff outliers --load RUN` (or `--hf DIR`: a transformers model, its held-out text named
    by the data.* overrides): print (and with `output`, write as JSON) the statistics."""
    check_request("outliers", split, overrides, sequences=sequences, batch_size=batch_size)
    refuse_megadiff_modeling_code(hf, "outliers")
    check_before_loading(load, hf, window, seq_length, overrides)
    model = load_model(load, hf, dtype, window)  # first: under torchrun it joins the ranks' process group
    console = command_console()
    cfg = evaluation_config(model.cfg, seq_length, overrides)
    ensure_prepared(cfg)
    prefixes, _ = training_blend(cfg.data)
    datasets = [held_out_dataset(source_config(cfg, prefix), model.tokenizer, split, sequences, console)
                for prefix in prefixes]  # sequences from each source of a blend
    counts = [min(sequences, len(dataset)) for dataset in datasets]
    batches = (tokens for dataset, count in zip(datasets, counts)
               for tokens, _ in sample_batches(dataset, list(share(range(count))), batch_size))
    with command_progress("outliers") as progress:
        task = ProgressTask(progress, ", ".join(prefixes), sum(share_size(count) for count in counts))
        report = record_activations(model, batches, lambda tokens: task.advance(len(tokens), tokens.numel()))
    variant = type(model.hf).__name__ if isinstance(model, HFCausalLM) else model.cfg.model.variant
    report.update(checkpoint=str(model.checkpoint_dir), variant=variant, split=split,
                  data=prefixes, sequences=sum(counts), seq_length=cfg.model.seq_length)
    table = Table(title=f"{report['checkpoint']} ({report['variant']}): largest |activations| over "
                        f"{report['sequences']} sequences of {report['seq_length']} tokens")
    table.add_column("activation")
    for column in [f"top-{k}" for k in TOP] + ["median"]:
        table.add_column(column, justify="right")
    for name in ("attention_logits", "hidden_states"):
        row = report[name]
        table.add_row(name.replace("_", " "), *(f"{row[f'top_{k}']:.1f}" if f"top_{k}" in row else "-" for k in TOP),
                      f"{row['median']:.2f}")
    console.print(table)
    write_report(console, report, output)
    return 0
