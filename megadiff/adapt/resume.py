"""The DeepSpeed checkpoint an adaptation rerun resumes from: its marker checked before the minutes of start-up
(model, head selection, DeepSpeed), its files' damage named when DeepSpeed reads them (a traceback from inside
torch.load or a bare AssertionError of DeepSpeed's file list, before)."""
from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import torch

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from megadiff.adapt.deepspeed_setup import NO_WEIGHT_DECAY, zero_stage
from megadiff.adapt.settings import TrainSection
from megadiff.config import ConfigError
from megadiff.errors import MegadiffError
from megadiff.files import ITERATION_PREFIX, appears, numbered_dirs

LATEST_FILE = "latest"  # beside the checkpoints: the tag a rerun resumes from (DeepSpeed's name for it)
MODEL_STATES = "*model_states.pt"  # one at least in every DeepSpeed checkpoint, whatever the ZeRO stage
OPTIMIZER_STATES = "*optim_states.pt"  # one a data-parallel rank
# what DeepSpeed's optimizer files hold besides tensors and containers (its loss scalers' settings, ZeRO's stage,
# where each parameter's fragment lies in its flat partition): all data, no code runs as they are read
DEEPSPEED_STATE_TYPES = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class DamagedCheckpoint(MegadiffError):
    """A checkpoint of the run that cannot be resumed from."""


def whole_checkpoints(checkpoint_dir: Path) -> list[str]:
    return [path.name for _, path in numbered_dirs(checkpoint_dir, ITERATION_PREFIX) if any(path.glob(MODEL_STATES))]


def resume_point(checkpoint_dir: Path, rank: int, world: int, ds_config: dict) -> Path | None:
    """The checkpoint the marker names (None without a marker: a first run), refused where it is no whole one,
    cannot be loaded by an engine of `world` ranks under `ds_config`, or lacks this rank's optimizer shard
    (each rank reads its own: one failing alone would leave the others waiting in DeepSpeed's collectives)."""
    marker = checkpoint_dir / LATEST_FILE
    if not marker.is_file():
        return None
    tag = marker.read_text(errors="replace").strip()
    path = checkpoint_dir / tag
    if not (tag.startswith(ITERATION_PREFIX) and "/" not in tag and any(path.glob(MODEL_STATES))):
        whole = whole_checkpoints(checkpoint_dir)
        fix = f"write the one to resume from ({', '.join(whole)}) into it" if whole else "remove it to start afresh"
        raise DamagedCheckpoint(f"{marker} names {tag!r}, which is no whole checkpoint in {checkpoint_dir}: {fix}, "
                                "or give a new output_dir")
    _check_loadable_here(path, world, ds_config)
    _refuse_code_in_files(path)
    shard = f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # with a bf16_ prefix under DeepSpeed's bf16 optimizer
    written_here = saved_dp_world_size(path) in (None, world)  # else loaded whole (reshard.universal_form)
    # looked for a while: NFS lists the files another node saved a moment late (a requeued job starts at once)
    if written_here and any(path.glob(OPTIMIZER_STATES)) and not appears(path, matching=shard):
        raise DamagedCheckpoint(f"{path} lacks rank {rank}'s optimizer state ({shard}): a checkpoint copied in "
                                f"part?{_others(path)}")
    return path


def _check_loadable_here(checkpoint: Path, world: int, ds_config: dict) -> None:
    """Refuse a checkpoint that DeepSpeed cannot load into this run's engine, before the model loads (DeepSpeed
    reads it once the model and its engine are built). Each failed there, or was called damaged: ZeRO-3 against
    ZeRO-1/2 (partitioned weights, other files), bf16 against another precision (other files). Another number of
    data-parallel ranks loads its universal form (reshard.universal_form)."""
    saved = _saved_engine(checkpoint)
    if saved is None:
        return
    saved_stage, stage = zero_stage(saved.get("ds_config", {})), zero_stage(ds_config)
    if (saved_stage == 3) != (stage == 3):
        raise ConfigError(f"{checkpoint} was written under ZeRO-{saved_stage}, and this run's deepspeed config asks "
                          f"for ZeRO-{stage}: DeepSpeed reads ZeRO-3 checkpoints under ZeRO-3 only, and the others "
                          f"under ZeRO-1/2 only. Resume under ZeRO-{saved_stage} or give a new output_dir")
    saved_precision, precision = _precision(saved.get("ds_config", {})), _precision(ds_config)
    if (saved_precision == "bf16") != (precision == "bf16"):
        raise ConfigError(f"{checkpoint} was written in {saved_precision}, and this run trains in {precision}: "
                          "DeepSpeed keeps bf16 optimizer state in files of their own. Resume with "
                          f"train.precision={saved_precision} or give a new output_dir")


def _refuse_code_in_files(checkpoint: Path) -> None:
    """Refuse a checkpoint file whose pickle names anything but the types DeepSpeed's files are made of, unread:
    DeepSpeed reads them with torch.load(weights_only=False), so a checkpoint from elsewhere (downloaded, shared)
    ran whatever code its pickles named as it resumed. Read memory-mapped, the tensors stay on disk; damage is left
    for DeepSpeed's load to name (damage_named)."""
    for file in sorted(checkpoint.glob("*.pt")):
        try:
            with torch.serialization.safe_globals(DEEPSPEED_STATE_TYPES):
                torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as error:
            raise DamagedCheckpoint(f"{file} holds more than DeepSpeed's checkpoints do ({_what_it_names(error)}): "
                                    "refused unread, since loading it would run code from the checkpoint") from error
        except (OSError, EOFError, RuntimeError):
            continue


def _what_it_names(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only refusal that names the global (its other lines advise loading anyway)."""
    lines = [line.strip() for line in str(error).splitlines()[1:]
             if line.strip() and not line.startswith("Check the documentation")]
    return lines[-1].removeprefix("WeightsUnpickler error: ").split(". Please use")[0] if lines else str(error)


def saved_dp_world_size(checkpoint: Path) -> int | None:
    """The number of data-parallel ranks that wrote `checkpoint` (None where its model states cannot be read)."""
    saved = _saved_engine(checkpoint)
    return None if saved is None else saved.get("dp_world_size")


def _saved_engine(checkpoint: Path) -> dict | None:
    """What DeepSpeed recorded of its engine in the checkpoint's model states (dp_world_size, ds_config: read
    memory-mapped, its tensors stay on disk); None where they cannot be read, damage that DeepSpeed's load names
    (damage_named)."""
    try:
        states = torch.load(min(checkpoint.glob(MODEL_STATES)), map_location="cpu", mmap=True, weights_only=True)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError):
        return None
    return states if isinstance(states, dict) else None


def _precision(ds_config: dict) -> str:
    """The train.precision DeepSpeed trains in under `ds_config` (its optimizer files are named bf16_... in bf16)."""
    return next((name for name in ("bf16", "fp16") if ds_config.get(name, {}).get("enabled") is True), "fp32")


@contextlib.contextmanager
def damage_named(checkpoint: Path):
    """DeepSpeed's load of `checkpoint`: a file missing or cut short as a DamagedCheckpoint naming it."""
    try:
        yield
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, AssertionError) as error:
        if isinstance(error, torch.OutOfMemoryError):  # a RuntimeError too, but the device's, not the files'
            raise
        detail = str(error).splitlines()[0] if str(error) else "a file it lists is missing"
        raise DamagedCheckpoint(f"{checkpoint} cannot be resumed from ({type(error).__name__}: {detail}): a "
                                f"checkpoint copied or written in part?{_others(checkpoint)}") from error


def _others(checkpoint: Path) -> str:
    others = [name for name in whole_checkpoints(checkpoint.parent) if name != checkpoint.name]
    return f" The run's other checkpoints: {', '.join(others)} (name one in {LATEST_FILE})" if others else ""


def keep_this_runs_optimizer_settings(optimizer, train: TrainSection) -> None:
    """After a checkpoint is loaded: Adam's betas, eps and weight decay, and the norm the gradients are clipped at,
    are this run's config's. Loading the optimizer state replaced them with the saving run's, so a rerun that
    changed them trained on with the old ones, silently (its lr schedule followed the config): torch's
    Optimizer.load_state_dict restores Adam's under every ZeRO stage, and DeepSpeed's ZeRO-1/2 and BF16 optimizers
    restore their clip_grad, which they clip with (the engine's gradient_clipping is read once, at their start).
    Biases and norm weights stay undecayed."""
    for group in optimizer.param_groups:
        group.update(betas=tuple(train.adam_betas), eps=train.adam_eps,
                     weight_decay=0.0 if group.get(NO_WEIGHT_DECAY) else train.weight_decay)
    if hasattr(optimizer, "clip_grad"):  # ZeRO's and the BF16 optimizer (ZeRO-0's torch one: the engine clips)
        optimizer.clip_grad = train.grad_clip


def keep_this_runs_loss_scaling(optimizer, configured) -> None:
    """After a checkpoint is loaded: the loss scaler is the one this run's DeepSpeed JSON made (`configured`, taken
    before the load), but where both are dynamic: the saved scale and its count of good steps go on then. DeepSpeed's
    ZeRO optimizers load the saving run's scaler with their state, so a rerun given a lower fp16.loss_scale (the cure
    a run stopped by overflowing steps is told) kept the old one and overflowed again, or another kind of scaling
    (static against dynamic) was ignored."""
    loaded = getattr(optimizer, "loss_scaler", None)
    if configured is None or loaded is None or (configured.dynamic and loaded.dynamic):
        return
    optimizer.loss_scaler = configured
    optimizer.dynamic_loss_scale = configured.dynamic
