"""The training state a checkpoint carries beside the weights, and where a run starts from.

Rerunning a command continues from the latest checkpoint of its output_dir. Without one,
`checkpoint.load` names an initial checkpoint (e.g. a 4K run for the 64K extension); with
`checkpoint.reset_iteration` its iteration count, data position and LR schedule start afresh.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch.distributed as dist
from megatron.core.datasets.utils import normalize

from megadiff.checkpoint.format import (
    CHECKPOINTS_DIR, CheckpointError, checkpoint_config, checkpoint_tokenizer_spec, latest_checkpoint,
    resolve_checkpoint_dir,
)
from megadiff.checkpoint.training_checkpoint import (
    load_training_checkpoint, optimizer_layout, read_train_state, saved_optimizer_format,
)
from megadiff.config import Config, ConfigError, TrainConfig, padded_vocab_size, resolved_architecture
from megadiff.config.validate import parse_blend
from megadiff.data.locations import training_blend
from megadiff.data.manifest import read_alike, tokenizer_identity
from megadiff.data.prepared_dataset import prepared_files_digest

# what megatron's sample order is made from: a continued run changing one reads on from its position
# in another order
DATA_ORDER_KEYS = (("data", "prefix"), ("data", "blend"), ("data", "bundled_corpus"), ("data", "split"),
                   ("data", "length_upsampling"), ("data", "length_upsampling_unit"), ("train", "seed"),
                   ("model", "seq_length"))
# model keys a continued run may change: they do not alter the weights' shapes or meaning (the
# vocabulary's padding multiple: as long as the padded size stays, _check_same_vocabulary)
CHANGEABLE_MODEL_KEYS = {"seq_length", "rope_theta", "rope_scaling", "attention_backend", "sdpa_kernels",
                         "transformer_impl", "make_vocab_size_divisible_by"}
# of those, what changes every attention score the weights were trained with: said at the start (a length
# extension changes them on purpose; a resumed run's override may not)
POSITION_KEYS = ("seq_length", "rope_theta", "rope_scaling")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    skipped_spikes: int = 0
    loss_scale_overflows: int = 0  # fp16: steps its loss scaler skipped
    # the first iteration of the streak of steps skipped for a non-finite loss or gradient, or a spike, that the
    # run is in (None once a step updates): checkpoint.keep_last keeps the last checkpoint saved before it
    skipping_since: int | None = None
    spike_history: dict = field(default_factory=dict)  # the spike guard's window (training/spikes.py)
    scheduler: dict | None = None
    layout: dict = field(default_factory=dict)
    data_samples: int = 0  # the training samples the data order was drawn for
    # the loss and seconds of the updating steps since the last record (observability.metrics.StepMeans):
    # a run stopped between two records records the same means once resumed
    unrecorded: dict = field(default_factory=dict)
    tokenizer: str | None = None  # tokenizer_identity of data.tokenizer: what the embeddings' rows stand for
    data: dict = field(default_factory=dict)  # each training prefix's prepared_files_digest: data prepared again

    def to_dict(self) -> dict:
        return asdict(self)


def current_layout(cfg: Config) -> dict:
    p = cfg.parallel
    return {"world_size": dist.get_world_size(), "tensor": p.tensor, "pipeline": p.pipeline,
            "virtual_pipeline": p.virtual_pipeline, "context": p.context}


def _check_same_model(saved: Config, cfg: Config, where: Path, own: bool) -> None:
    before, now = resolved_architecture(saved.model), resolved_architecture(cfg.model)
    differing = [key for key, value in now.items() if key not in CHANGEABLE_MODEL_KEYS and before[key] != value]
    if differing:
        details = ", ".join(f"model.{k}: {before[k]!r} -> {now[k]!r}" for k in differing)
        # the run's own checkpoint: another output_dir starts afresh; checkpoint.load's: another one to start from
        other = "use a new output_dir" if own else "load a checkpoint of this model (checkpoint.load)"
        settings = " ".join(f"model.{k}={before[k]}" for k in differing)
        raise ConfigError(f"the checkpoint {where} was trained with another model ({details}); "
                          f"{other}, or the checkpoint's model settings ({settings})")


def _check_same_vocabulary(saved: Config, cfg: Config, where: Path) -> None:
    """The embedding and output layer keep their rows. The vocabulary is padded to a multiple of
    make_vocab_size_divisible_by x the tensor-parallel size, and megatron loads another padded size
    without a word: rows cut off, or zero-filled (zero logits that draw probability from every token)."""
    rows, now = padded_vocab_size(saved.model, saved.parallel.tensor), padded_vocab_size(cfg.model, cfg.parallel.tensor)
    if rows == now:
        return
    tensor = cfg.parallel.tensor
    multiple = _multiple_keeping(rows, cfg, saved.model.make_vocab_size_divisible_by * saved.parallel.tensor)
    fix = (f"set model.make_vocab_size_divisible_by={multiple}, which pads to {rows} at parallel.tensor={tensor}"
           if multiple else
           f"keep parallel.tensor={saved.parallel.tensor}, or convert the Hugging Face model again after padding its "
           "vocabulary (resize_token_embeddings(..., pad_to_multiple_of=128), docs/conversion.md)")
    raise ConfigError(f"model.make_vocab_size_divisible_by: {where} holds a vocabulary of {saved.model.vocab_size} "
                      f"padded to {rows} rows ({saved.model.make_vocab_size_divisible_by} x parallel.tensor="
                      f"{saved.parallel.tensor}), this run would pad it to {now} "
                      f"({cfg.model.make_vocab_size_divisible_by} x parallel.tensor={tensor}): {fix}")


def _trained_tokenizer(path: Path, saved_cfg: Config, saved: dict | None) -> tuple[str | None, str | None]:
    """(tokenizer_identity, the tokenizer it was read from now) of what a checkpoint's embedding rows stand for: as
    its training state records it (read as it trained: what its path holds now may have been replaced), else (a
    model-only checkpoint) its own tokenizer's."""
    if saved is not None:
        return saved.get("tokenizer"), None
    spec = checkpoint_tokenizer_spec(path, saved_cfg)
    return tokenizer_identity(spec), spec


def _check_same_tokenizer(cfg: Config, tokenizer: str | None, trained: tuple[str | None, str | None],
                          saved_cfg: Config, path: Path) -> None:
    """Another tokenizer of the vocabulary's size passes every shape check, and reads text into other ids."""
    identity, spec = trained
    if None in (tokenizer, identity) or tokenizer == identity:
        return
    if spec is not None and read_alike(cfg.data.tokenizer, spec):
        return
    raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer} reads text into other ids than "
                      f"{saved_cfg.data.tokenizer}, which {path} was trained with; keep that tokenizer, "
                      f"or start a new output_dir from the checkpoint with checkpoint.load={path} "
                      "checkpoint.reset_iteration=true")


def _multiple_keeping(rows: int, cfg: Config, saved_step: int) -> int | None:
    """The make_vocab_size_divisible_by padding cfg's vocabulary to `rows` at its parallel.tensor: the one keeping
    the checkpoint's step (its multiple x its parallel.tensor), else the largest power of two below that (a small
    multiple keeps the rows at larger tensor sizes too), else rows // tensor, which keeps them at this one alone."""
    tensor = cfg.parallel.tensor
    candidates = [saved_step // tensor] if saved_step % tensor == 0 else []
    candidates += [2 ** k for k in reversed(range((saved_step // tensor).bit_length()))]
    candidates += [rows // tensor] if rows % tensor == 0 else []
    return next((m for m in candidates if -(-cfg.model.vocab_size // (m * tensor)) * m * tensor == rows), None)


def _starting_checkpoint(cfg: Config) -> tuple[Path | None, bool]:
    """(checkpoint to load, whether it is this run's own) -- own checkpoints resume exactly."""
    own = latest_checkpoint(Path(cfg.output_dir) / CHECKPOINTS_DIR)
    if own is not None:
        return own, True
    if cfg.checkpoint.load:
        try:
            return resolve_checkpoint_dir(cfg.checkpoint.load), False
        except CheckpointError as err:  # a recipe's load (the 64K one's 4K run) the user may never have typed
            raise ConfigError(f"checkpoint.load: {err}") from None
    return None, False


def _check_same_optimizer(saved: Config, cfg: Config, where: Path) -> None:
    """megatron-core loads optimizer state only into the optimizer that saved it."""
    for key, before, now in (("parallel.distributed_optimizer", saved.parallel.distributed_optimizer,
                              cfg.parallel.distributed_optimizer),
                             ("train.precision", saved.train.precision, cfg.train.precision)):
        if before != now:
            raise ConfigError(f"{key}: the optimizer state of {where} was saved with {before!r}, this run has "
                              f"{now!r}. Keep {before!r}, or start a new output_dir from it with checkpoint.load="
                              f"{where} checkpoint.load_optimizer=false")


def _saved_optimizer_format(cfg: Config, where: Path) -> str:
    """The format of the checkpoint's distributed optimizer state, refused where it cannot load into this run."""
    saved = saved_optimizer_format(where)
    if saved["format"] != "parallel":  # loads into any layout
        return saved["format"]
    now = optimizer_layout(cfg, dist.get_world_size())
    if saved["layout"] != now:
        raise ConfigError(
            f"checkpoint.optimizer_format: the optimizer state of {where} was saved in the parallel format, which "
            f"loads only into the layout that saved it ({_layout_text(saved['layout'])}); this run has "
            f"{_layout_text(now)}. Resume it in its layout with checkpoint.optimizer_format=reshardable (its next "
            "checkpoint loads into any layout), or start a new output_dir from its weights with "
            f"checkpoint.load={where} checkpoint.load_optimizer=false")
    return saved["format"]


def _layout_text(layout: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in layout.items())


@dataclass
class Start:
    """Where a run starts, known before its data and model are built."""
    path: Path | None = None        # the checkpoint loaded, if any
    own: bool = False               # this run's own: it resumes exactly (RNG states included)
    saved: dict | None = None       # the checkpoint's training state; None for a model-only checkpoint
    load_optimizer: bool = False
    optimizer_format: str = "reshardable"  # of the checkpoint's distributed optimizer state, which a load reads
    continues: bool = False         # its iteration count, data position and LR schedule go on
    tokenizer: str | None = None    # tokenizer_identity of the run's data.tokenizer
    data_changes: list[str] = field(default_factory=list)  # "key: before -> now" of DATA_ORDER_KEYS, if it continues
    position_changes: list[str] = field(default_factory=list)  # "model.key: before -> now" of POSITION_KEYS
    # the schedule the checkpoint's run trained on, if this run continues it: the lr may jump where this run's differs
    checkpoint_train: TrainConfig | None = None

    def position(self) -> tuple[int, int]:
        """(iterations done, samples consumed) the run starts from."""
        return (self.saved["iteration"], self.saved["consumed_samples"]) if self.continues else (0, 0)

    def data_samples(self, cfg: Config) -> tuple[int, int]:
        """(the training samples to draw the data order for, those the checkpoint's order was drawn for, 0 where
        the run does not read on in it). megatron's order of a source read more than once depends on that count,
        so a resumed run keeps its checkpoint's where it reads no further (another global batch size, fewer
        iterations) and reads on in the same order; train.planned_samples sets it from the start."""
        iteration, consumed = self.position()
        reads = consumed + max(cfg.train.iters - iteration, 0) * cfg.train.global_batch_size
        # other data reads another order whatever the count
        drawn_for = self.saved["data_samples"] if self.continues and not self.data_changes else 0
        return max(reads, drawn_for, cfg.train.planned_samples or 0), drawn_for


def _drawn_before_data_samples_were_kept(saved: dict, saved_cfg: Config) -> int:
    """The samples the order of a checkpoint saved before `data_samples` was kept was drawn for: its run drew
    for what it read to its train.iters, and read a global batch per iteration since it started."""
    remaining = max(saved_cfg.train.iters - saved["iteration"], 0)
    return saved["consumed_samples"] + remaining * saved_cfg.train.global_batch_size


def _check_known_state(saved: dict | None, where: Path) -> None:
    unknown = sorted(set(saved or {}) - {f.name for f in fields(TrainState)})
    if unknown:
        raise CheckpointError(f"{where} keeps training state this megadiff does not know ({', '.join(unknown)}): "
                              "it was saved by a newer version; resume it with that version")


def _as_compared(name: str, value):
    """A setting as compared: the paths of data.prefix and data.blend absolute, as a checkpoint's config saved in
    another working directory gives them, where the rerun's config may give them from its own; data.blend's
    weights as megatron normalises them, which orders the samples of [70, a, 30, b] as those of [0.7, a, 0.3, b]."""
    if name == "data.blend" and value:
        prefixes, weights = parse_blend(value)
        return [os.path.abspath(prefix) for prefix in prefixes], weights and normalize(weights)
    if name == "data.prefix" and value:
        return os.path.abspath(value)
    return value


def _changes(pairs: list[tuple[str, object, object]]) -> list[str]:
    """Each (name, before, now) that differs, as "name: before -> now"."""
    return [f"{name}: {before!r} -> {now!r}" for name, before, now in pairs
            if _as_compared(name, before) != _as_compared(name, now)]


def training_data_digests(cfg: Config) -> dict[str, str]:
    """{prefix: prepared_files_digest} of the data the run trains on (prepared)."""
    return {prefix: prepared_files_digest(prefix) for prefix in training_blend(cfg.data)[0]}


def prepared_again(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """The prefixes a continued run trains on whose files differ from those its checkpoint trained on (data
    prepared again under the same name: other sources, another tokenizer, files added)."""
    return [prefix for prefix, digest in now.items() if before.get(prefix, digest) != digest]


def plan_start(cfg: Config) -> Start:
    """The starting checkpoint, checked against the config (model, optimizer, batch size) before
    any data is prepared or model built."""
    path, own = _starting_checkpoint(cfg)
    tokenizer = tokenizer_identity(cfg.data.tokenizer)
    if path is None:
        return Start(tokenizer=tokenizer)
    saved_cfg = checkpoint_config(path)
    _check_same_model(saved_cfg, cfg, path, own)
    _check_same_vocabulary(saved_cfg, cfg, path)
    saved = read_train_state(path)  # None for a model-only checkpoint (e.g. converted from HF)
    _check_known_state(saved, path)
    if saved is not None and "data_samples" not in saved:
        saved["data_samples"] = _drawn_before_data_samples_were_kept(saved, saved_cfg)
    load_optimizer = saved is not None and (own or cfg.checkpoint.load_optimizer)
    optimizer_format = "reshardable"
    if load_optimizer:
        _check_same_optimizer(saved_cfg, cfg, path)
        optimizer_format = _saved_optimizer_format(cfg, path)
    continues = saved is not None and (own or not cfg.checkpoint.reset_iteration)
    pairs = [(f"{section}.{key}", getattr(getattr(saved_cfg, section), key), getattr(getattr(cfg, section), key))
             for section, key in DATA_ORDER_KEYS]
    changes = _changes(pairs)
    positions = _changes([(f"model.{key}", getattr(saved_cfg.model, key), getattr(cfg.model, key))
                          for key in POSITION_KEYS])
    # a model-only checkpoint (converted from Hugging Face) has no count to continue: its weights are taken on,
    # with their tokenizer, unless checkpoint.reset_iteration says the run starts afresh from them
    if continues or (saved is None and not cfg.checkpoint.reset_iteration):
        _check_same_tokenizer(cfg, tokenizer, _trained_tokenizer(path, saved_cfg, saved), saved_cfg, path)
    start = Start(path, own, saved, load_optimizer, optimizer_format, continues,
                  data_changes=changes if continues else [],
                  position_changes=positions, tokenizer=tokenizer,
                  checkpoint_train=saved_cfg.train if continues else None)
    (iteration, consumed), batch = start.position(), cfg.train.global_batch_size
    if start.continues and not own and iteration >= cfg.train.iters:
        raise ConfigError(f"train.iters: {path} is at iteration {iteration}, and this run continues its count up to "
                          f"train.iters={cfg.train.iters}: nothing would be trained. Give train.iters={iteration} "
                          "plus the iterations to run, or checkpoint.reset_iteration=true to count from 0")
    if consumed % batch:
        raise ConfigError(f"train.global_batch_size: {path} has consumed {consumed} samples, not a whole number of "
                          f"global batches of {batch}; keep the checkpoint's {saved_cfg.train.global_batch_size}")
    return start


def restore(cfg: Config, start: Start, engine, scheduler) -> tuple[TrainState, str]:
    """Load the starting checkpoint, if any, into the engine and scheduler; says what it did."""
    fresh = TrainState(layout=current_layout(cfg), tokenizer=start.tokenizer)
    if start.path is None:
        return fresh, "starting from scratch"
    load_training_checkpoint(start.path, engine.unwrapped(), engine.optimizer, load_optimizer=start.load_optimizer,
                             optimizer_format=start.optimizer_format, restore_rng=start.own and start.saved is not None
                             and start.saved["layout"] == fresh.layout)
    if not start.continues:
        return fresh, f"initialised from {start.path} (iteration count, data position and LR schedule start afresh)"
    state = TrainState(**start.saved)
    if state.scheduler is not None:
        scheduler.load_state_dict(state.scheduler)
    resharded = "" if state.layout == fresh.layout else f", resharded from {state.layout}"
    state.layout, state.tokenizer = fresh.layout, fresh.tokenizer
    # checkpoint.load only starts a new output_dir: a rerun goes on from its own checkpoints
    ignored = f" (not checkpoint.load={cfg.checkpoint.load}: this output_dir has its own)" \
        if start.own and cfg.checkpoint.load else ""
    return state, f"resumed from {start.path} at iteration {state.iteration}{resharded}{ignored}"
