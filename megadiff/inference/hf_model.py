"""A Hugging Face causal LM behind the calls the checkpoint commands make of a megadiff checkpoint,
so `evaluate`, `icl`, `needles` and `outliers` measure a Dex/DAA-adapted export (the adaptation
papers' in-context learning and needle retrieval), the model it was adapted from, or any megadiff
export as they measure a run.

transformers runs the model as it always does (its own cache, RoPE and attention). What the
commands read of a run's config is the window, the tokenizer and the data: here the model's
max_position_embeddings (or --window), the tokenizer files beside its weights and, for a megadiff
export, its run's data settings (split and prefix; data.* overrides name others).
"""
from __future__ import annotations

import copy
import pickle
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from megadiff.checkpoint.single_process import LOSS_CHUNK_TOKENS, CausalLM, load_checkpoint
from megadiff.config import Config, ConfigError, build_config
from megadiff.config.loader import as_written, read_saved_config
from megadiff.convert.hf_io import SIDECAR_CONFIG
from megadiff.data.tokenizers import Tokenizer, load_tokenizer
from megadiff.errors import first_line, lacking_weights
from megadiff.models.transformer_config import PRECISION_DTYPES
from megadiff.parallel import compute_device, init_process_group


class HFCache:
    """A transformers cache with the KVCache calls the commands make. A mark holds no copy of the keys and values
    that hold every position (a 128K context's are gigabytes): rewinding crops them, and restores a copy of the
    rest of each layer's state taken at the mark (DINT's running sum, a sliding window's last keys and values)."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.new = lambda: DynamicCache(config=model.config)
        self.cache = self.new()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = self.new()

    def mark(self) -> tuple[int, list]:
        """This cache's state now, for rewind(): its length, and each layer as _marked() keeps it."""
        return self.length, [_marked(layer) for layer in self.cache.layers]

    def rewind(self, mark: tuple[int, list]) -> None:
        length, marked = mark
        self.cache.layers = [_rewound(at_mark, layer, length) for at_mark, layer in zip(marked, self.cache.layers)]


def _positional(layer) -> bool:
    """Whether `layer`'s keys and values hold one row per cached position and nothing else (a full-attention layer's,
    DINT's included: its running sum is a recurrent state beside them), so that their prefix is an earlier state's."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer

    full_attention = type(layer) is DynamicLayer or isinstance(layer, LinearAttentionAndFullAttentionLayer)
    return layer.is_initialized and full_attention


def _sliding(layer) -> bool:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized


def _marked(layer):
    """A copy of `layer` for rewind(): without its positional keys and values (rewind crops the cache's), with a
    sliding window's rows alone (the cache's are a view of the whole call's keys and values that made them), the
    rest copied as it is (a recurrent state, DINT's running sum, is written in place)."""
    if _positional(layer):
        return copy.deepcopy(layer, {id(layer.keys): None, id(layer.values): None})
    window_rows = {id(kept): kept.clone() for kept in (layer.keys, layer.values)} if _sliding(layer) else {}
    return copy.deepcopy(layer, window_rows)


def _rewound(at_mark, layer, length: int):
    """`layer` as it was at the mark (`at_mark`, of `length` positions). A sliding window's keys and values are the
    mark's own, not copied: the cache's calls replace them by new tensors, never write into them."""
    rewound = copy.deepcopy(at_mark, {id(kept): kept for kept in (at_mark.keys, at_mark.values)}
                            if _sliding(at_mark) else {})
    if _positional(layer):
        rewound.keys, rewound.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return rewound


class HFCausalLM:
    """model(ids, labels) -> next-token losses [B, N]; model.next_token_logits(ids [B, n], cache) ->
    [B, V]; model.logits_at(ids, positions) -> [B, P, V], on the model's device; `cfg` holds the
    window and the tokenizer."""

    def __init__(self, hf, path: str | Path, window: int, tokenizer: Tokenizer | None = None):
        """tokenizer: the directory's, where the caller has loaded it already."""
        self.hf, self.checkpoint_dir = hf, Path(path)
        if tokenizer is None:
            tokenizer = load_tokenizer(str(path), trust_remote_code=True)
        self.tokenizer: Tokenizer = tokenizer
        self.cfg: Config = hf_run_config(path, window)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    def new_cache(self, batch_size: int = 1, max_length: int | None = None) -> HFCache:
        return HFCache(self.hf)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, document_eod: int | None = None) -> torch.Tensor:
        """Next-token cross entropy [B, N] (fp32) of `labels`, as CausalLM's: the output layer runs
        over LOSS_CHUNK_TOKENS tokens at a time (a 64K sequence's whole logits would not fit)."""
        if document_eod is not None:
            raise ConfigError("--hf: a Hugging Face model attends across documents; data.document_masking does not "
                              "apply to it")
        hidden = self._hidden_states(input_ids)
        labels = labels.to(self.device)
        step = max(1, LOSS_CHUNK_TOKENS // labels.shape[0])
        return torch.cat([self._cross_entropy(hidden[:, i:i + step], labels[:, i:i + step])
                          for i in range(0, labels.shape[1], step)], dim=1)

    def _cross_entropy(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[B, n] losses, over [B * n, V] rows: torch sums a [B, V, n] layout's vocabulary far less exactly
        (2e-5 off at 100K ids, where the rows are 1e-6 off)."""
        logits = self._logits(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor, cache: HFCache | None = None) -> torch.Tensor:
        output = self.hf(input_ids=input_ids.to(self.device), past_key_values=None if cache is None else cache.cache,
                         use_cache=cache is not None, logits_to_keep=1)
        return output.logits[:, -1]

    @torch.no_grad()
    def logits_at(self, input_ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Only those positions' logits are formed (a 64K context's would not fit)."""
        return self._logits(self._hidden_states(input_ids)[:, positions])

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, N, H]: the decoder's output, which the model's forward hands to its head."""
        return self.hf.get_decoder()(input_ids=input_ids.to(self.device), use_cache=False).last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, n, H] decoder states -> [B, n, V] as the model's own forward makes them: its forward runs
        with the decoder answering `hidden`, so what it does after the head (Granite's logits_scaling,
        Gemma2's final_logit_softcapping, Cohere's logit_scale) is done too. The answer is a mixture of experts'
        decoder's output (its router logits None): Mixtral's, Qwen-MoE's forward reads them (for an auxiliary loss
        it computes only when asked), and a plain decoder's output made every such model refused."""
        from transformers.modeling_outputs import MoeModelOutputWithPast

        decoder = self.hf.get_decoder()
        decoder.forward = lambda *args, **kwargs: MoeModelOutputWithPast(last_hidden_state=hidden)
        try:
            placeholder = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            return self.hf(input_ids=placeholder, use_cache=False).logits
        finally:
            del decoder.forward  # the class's own again


def _export_data(path: str | Path) -> dict:
    """The data.* (and train.seed) defaults: a megadiff export's run's (its sidecar config), so that its
    held-out samples are the run's; the tokenizer the directory's own; across documents, as transformers
    attends."""
    sidecar = Path(path) / SIDECAR_CONFIG
    run = read_saved_config(sidecar) if sidecar.is_file() else {}
    if run.get("data", {}).get("document_masking"):
        warnings.warn(f"{path}'s run trained with data.document_masking, attending within each document; "
                      "transformers attends across them, so --hf's losses are not the run's: --load its checkpoint "
                      "for those", stacklevel=2)
    seed = {"train": {"seed": run["train"]["seed"]}} if "seed" in run.get("train", {}) else {}
    return {"data": {**as_written(run.get("data", {})), "tokenizer": str(path), "document_masking": False}, **seed}


def hf_run_config(path: str | Path, window: int) -> Config:
    """What the commands read of a run's config, for the transformers model in `path`: its window, its
    directory's tokenizer, and the data (_export_data)."""
    return build_config({"model": {"seq_length": window}, **_export_data(path)})


def hf_window(path: str | Path, window: int | None = None) -> int:
    """--window, else the model's max_position_embeddings (its config only: no weights are read)."""
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"--hf {path} is not a Hugging Face model directory (no config.json)")
    if window is not None and window < 1:
        raise ConfigError(f"--window must be at least 1, got {window}")
    with _refused_by_name(path):  # an architecture transformers does not know, code it lacks
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    window = window if window is not None else getattr(config, "max_position_embeddings", None)
    if not window:
        raise ConfigError(f"{path}'s config gives no max_position_embeddings: pass --window")
    return window


def load_hf_model(path: str | Path, dtype: str | None = None, window: int | None = None) -> HFCausalLM:
    """The transformers model in directory `path` (trust_remote_code: adapted and megadiff exports
    ship their code), in `dtype` (default: its config's), on this rank's device; under torchrun it
    joins the ranks' process group first (the commands share their work among ranks)."""
    from transformers import AutoModelForCausalLM

    if dtype is not None and dtype not in PRECISION_DTYPES:
        raise ConfigError(f"--dtype must be one of {list(PRECISION_DTYPES)}, got {dtype}")
    window = hf_window(path, window)
    init_process_group(timedelta(minutes=30))
    # a directory without tokenizer files is refused before the weights are read
    tokenizer = load_tokenizer(str(path), trust_remote_code=True)
    with _refused_by_name(path):  # weights cut short
        hf, loading = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, output_loading_info=True,
                                                           dtype=PRECISION_DTYPES[dtype] if dtype else "auto")
    lacking = lacking_weights(path, loading["missing_keys"])
    if lacking:  # measured, the random weights' numbers were reported as the model's
        raise ConfigError(f"--hf {lacking}")
    model = HFCausalLM(hf.to(compute_device()).eval(), path, window, tokenizer)
    _refuse_another_layout(model, path)
    return model


def _refuse_another_layout(model: HFCausalLM, path: str | Path) -> None:
    """The commands form logits from the decoder's states, a few positions at a time (a 64K context's whole logits
    would not fit): a model whose forward reads more of its decoder's output than the states (GPT-2's, an
    encoder's) is refused here, not failed inside its forward after the data was prepared."""
    try:
        model.logits_at(torch.zeros(1, 2, dtype=torch.long), [1])
    except (AttributeError, TypeError, KeyError, IndexError) as err:
        raise ConfigError(f"--hf {path}: a {type(model.hf).__name__}, whose forward does not run as a Llama-like "
                          f"decoder's (its decoder's states, then its head): not supported ({first_line(err)})"
                          ) from None


@contextmanager
def _refused_by_name(path: str | Path):
    """transformers' loading errors as a ConfigError naming the directory (its first line: the rest points at the
    hub, which is not read)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, SafetensorError, EOFError, pickle.UnpicklingError) as err:
        if isinstance(err, ConfigError):
            raise
        damaged = isinstance(err, (SafetensorError, EOFError, pickle.UnpicklingError))
        raise ConfigError(f"--hf {path} cannot be loaded: {first_line(err)}"
                          + (" (a weights file cut short by a download or copy?)" if damaged else "")) from None


def load_model(load: str | None, hf: str | None, dtype: str | None = None,
               window: int | None = None) -> CausalLM | HFCausalLM:
    """What a command measures: a megadiff checkpoint (--load) or a transformers model (--hf)."""
    if (load is None) == (hf is None):
        raise ConfigError("give one of --load (a megadiff run or checkpoint) and --hf (a Hugging Face model directory)")
    if hf is not None:
        return load_hf_model(hf, dtype, window)
    if window is not None:
        raise ConfigError("--window is a Hugging Face model's: a run's window is its model.seq_length")
    return load_checkpoint(load, PRECISION_DTYPES[dtype] if dtype else None)
