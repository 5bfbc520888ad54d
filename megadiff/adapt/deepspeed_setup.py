"""DeepSpeed for adaptation: the JSON config with its "auto" values filled from the adapt config,
process-group start-up, and the ZeRO-3 specifics.

The JSON files under configs/deepspeed/ hold what is DeepSpeed's own (ZeRO stage, optimizer type
and its options); batch sizes, learning rate, Adam's hyperparameters, clipping and precision are
"auto" and come from the adapt YAML, so one YAML drives every stage. The learning-rate schedule
is megadiff's (schedule.py), handed to deepspeed.initialize. A JSON value that is set and
disagrees with the YAML is a config error.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
from datetime import timedelta
from typing import Iterator

import torch

from megadiff.adapt.settings import FinetuneConfig, read_deepspeed_json
from megadiff.config import ConfigError

AUTO = "auto"

# what finds a step's NaN or inf gradients in DeepSpeed, which then leaves its update out (the run counts and bounds
# those steps: train.max_skipped_nan_iters): fp16's loss scaler always; in bf16 its overflow check, in fp32 the
# gradient norm. A JSON turning that off made one NaN step every weight's, in each later checkpoint and the export
GRADIENT_CHECKS = {"bf16": ("bf16", "check_grad_overflow"), "fp32": ("zero_optimization", "compute_grad_norm")}


# DeepSpeed settings megadiff's training loop depends on (dotted: within sections), with the values it runs under
# and what another one did: each trained other than the adapt config says, or failed only at the first step.
# The loop calls DeepSpeed's step() after every micro-step
LOOP_SETTINGS = {
    "managed_gradient_accumulation": ((True,), "DeepSpeed then applies an update at every micro-step, so each "
                                      "iteration made train.grad_accum updates of one micro-batch each, and the lr "
                                      "schedule ran train.grad_accum times as fast"),
    # the loss is normalised for averaged gradients (finetune._train_iteration)
    "gradient_allreduce_op": (("mean",), "DeepSpeed then sums the ranks' gradients, so the gradient norm, logged "
                              "and clipped at train.grad_clip, is the number of ranks times the global batch's"),
    # the batches are data-parallel: each rank reads its own samples
    "tensor_parallel.autotp_size": ((0, 1), "adaptation trains data-parallel (ZeRO) alone, each rank reading its "
                                    "own samples, which DeepSpeed's tensor parallelism refused at the first step, "
                                    "once the model had loaded"),
    # a checkpoint is committed (renamed, named in `latest`) as save_checkpoint returns: its files must be written
    "checkpoint.writer": ((None,), "megadiff commits a checkpoint once save_checkpoint has returned on every rank, "
                          "its files written; DeepSpeed's own writers (fast, or decoupled: written in the "
                          "background) failed as the engine started, once the model had loaded"),
    # megadiff's metrics go to W&B through logging.wandb_project (observability/wandb_sink.py)
    "wandb.enabled": ((False,), "DeepSpeed's own W&B monitor then writes its Train/Samples metrics into the "
                      "run's W&B run at its sample count (or starts a stray one in the working directory); "
                      "logging.wandb_project sends megadiff's metrics to W&B"),
}


def _fill(section: dict, key: str, value, where: str) -> None:
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif current != value:
        raise ConfigError(f"deepspeed: {where}{key} = {current!r} disagrees with the adapt config ({value!r}); "
                          f'set it to "auto" or change the adapt config')


def deepspeed_config(cfg: FinetuneConfig, world_size: int) -> dict:
    ds = copy.deepcopy(read_deepspeed_json(cfg.deepspeed))
    train = cfg.train
    _fill(ds, "train_micro_batch_size_per_gpu", train.micro_batch_size, "")
    _fill(ds, "gradient_accumulation_steps", train.grad_accum, "")
    _fill(ds, "train_batch_size", train.micro_batch_size * train.grad_accum * world_size, "")
    _fill(ds, "gradient_clipping", train.grad_clip, "")
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
    params = optimizer.setdefault("params", {})
    _fill(params, "lr", train.lr, "optimizer.params.")
    _fill(params, "betas", list(train.adam_betas), "optimizer.params.")
    _fill(params, "eps", train.adam_eps, "optimizer.params.")
    _fill(params, "weight_decay", train.weight_decay, "optimizer.params.")
    if "scheduler" in ds:
        raise ConfigError(f"deepspeed: {cfg.deepspeed} has a scheduler section; the schedule is megadiff's "
                          "(train.lr, train.warmup_ratio, train.min_lr_ratio): remove it")
    if ds.get("checkpoint", {}).get("load_universal"):
        # the load of every rerun would look for the universal form that only reshard.universal_form makes
        raise ConfigError(f"deepspeed: {cfg.deepspeed} sets checkpoint.load_universal, but megadiff adapt's "
                          "checkpoints are DeepSpeed's own, which it resumes as written, and converts to the "
                          "universal form itself for a rerun on another number of ranks: remove it")
    _bf16_section_by_its_name(ds, cfg.deepspeed)
    _refuse_unchecked_gradients(ds, train.precision, cfg.deepspeed)
    _refuse_other_loop_settings(ds, cfg.deepspeed)
    for precision in ("bf16", "fp16"):
        _fill(ds.setdefault(precision, {}), "enabled", train.precision == precision, f"{precision}.")
    ds.setdefault("steps_per_print", 2**31 - 1)  # megadiff logs; keep DeepSpeed's own step log quiet
    _refuse_what_deepspeed_refuses(ds, cfg.deepspeed)
    return ds


def _refuse_what_deepspeed_refuses(ds: dict, path: str) -> None:
    """DeepSpeed's own reading of the JSON (its removed sections, an unknown or misspelt key, a value of the wrong
    kind), before any compute: in deepspeed.initialize it came once the data was tokenized, the model loaded and
    the heads measured, minutes into a large model's run."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    # the global batch was checked against the launcher's world size, which DeepSpeed reads only once ranks run
    without_global_batch = {key: value for key, value in ds.items() if key != "train_batch_size"}
    try:
        DeepSpeedConfig(without_global_batch)
    # pydantic's are ValueErrors; the others are its checks', and its reading of a value of another kind
    except (DeepSpeedConfigError, ValueError, TypeError, AssertionError, AttributeError, KeyError) as err:
        said = " ".join(line.strip() for line in str(err).splitlines() if not line.strip().startswith("For further"))
        raise ConfigError(f"deepspeed: {path}: DeepSpeed refuses it: {said or type(err).__name__}") from None


def loading_universal(ds: dict) -> dict:
    """`ds` for an engine that loads a checkpoint's universal form (a load setting alone: saves are as before)."""
    return {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}


# DeepSpeed's older name of the bf16 section, which it reads only where there is no "bf16" section: the one added
# here shadowed it, and its settings (its enabled among them, against train.precision) went unread
LEGACY_BF16_SECTION = "bfloat16"


def _bf16_section_by_its_name(ds: dict, path: str) -> None:
    if LEGACY_BF16_SECTION not in ds:
        return
    if "bf16" in ds:
        raise ConfigError(f"deepspeed: {path} has both a bf16 and a {LEGACY_BF16_SECTION} section, and DeepSpeed "
                          f"reads the bf16 one alone: keep one")
    ds["bf16"] = ds.pop(LEGACY_BF16_SECTION)


def _refuse_unchecked_gradients(ds: dict, precision: str, path: str) -> None:
    section, key = GRADIENT_CHECKS.get(precision, (None, None))
    if section is not None and ds.get(section, {}).get(key) is False:
        raise ConfigError(f"deepspeed: {path} sets {section}.{key} = false: under train.precision={precision} "
                          "DeepSpeed then applies a step's NaN or inf gradients, and one such step makes every "
                          "weight NaN (in each later checkpoint and the export): remove it")


def _refuse_other_loop_settings(ds: dict, path: str) -> None:
    for key, (runs_under, what_it_did) in LOOP_SETTINGS.items():
        value = _setting(ds, key)
        if value != AUTO and _as_deepspeed_reads(value) not in runs_under:
            raise ConfigError(f"deepspeed: {path} sets {key} = {json.dumps(value)}: {what_it_did}; remove it")


def _setting(ds: dict, dotted_key: str):
    *sections, key = dotted_key.split(".")
    for section in sections:
        ds = ds.get(section, {})
        if not isinstance(ds, dict):  # DeepSpeed's own check names it
            return AUTO
    return ds.get(key, AUTO)


def _as_deepspeed_reads(value):
    return value.lower() if isinstance(value, str) else value  # its names of operations, in any case


# a param group's key: its parameters never decay, whatever train.weight_decay (read again on resume)
NO_WEIGHT_DECAY = "no_weight_decay"


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    """The trained parameters as AdamW's param groups. Which decay is the Hugging Face Trainer's rule, the one
    the DAA paper's adamw_torch runs followed (weight decay 0.01): never biases and norm weights (megatron,
    and so pretraining, leaves them alike), every other trained tensor by train.weight_decay. One flat group
    decayed Qwen2's attention biases too, and every norm weight of a run training them."""
    from transformers import Trainer

    decayed_names = set(Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    decayed = [param for name, param in trained if name in decayed_names]
    kept = [param for name, param in trained if name not in decayed_names]
    # no empty group: a run training no bias or norm keeps the one group its earlier checkpoints hold
    groups = [{"params": decayed}] if decayed else []
    return groups + ([{"params": kept, "weight_decay": 0.0, NO_WEIGHT_DECAY: True}] if kept else [])


def zero_stage(ds: dict) -> int:
    return ds.get("zero_optimization", {}).get("stage", 0)


def model_dtype(cfg: FinetuneConfig) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]


def skip_cpu_shm_comm_build() -> None:
    """On the CPU accelerator DeepSpeed JIT-compiles a shared-memory all-reduce op (~30 s) when its
    communication backend starts. Only inference all-reduce (AutoTP) uses it, never ZeRO training,
    and there is no switch for it: marking the op incompatible in `deepspeed.ops.__compatible_ops__`
    (which DeepSpeed reads for exactly this decision) skips the build. MEGADIFF_DS_SHM_COMM=1 keeps it."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or os.environ.get("MEGADIFF_DS_SHM_COMM") == "1":
        return
    import deepspeed.ops

    if "__compatible_ops__" in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:  # not probed yet: probing runs compilers (~2 s); nothing else reads the table
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def launcher_world_size() -> int:
    """The world size the launcher (torchrun, deepspeed, Slurm via torchrun) announces; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# what a run without a launcher sets for DeepSpeed, which reads them as it starts and while it runs
WORLD_OF_ONE_VARIABLES = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"))


@contextlib.contextmanager
def rendezvous_variables_restored() -> Iterator[None]:
    """The run's block, after which WORLD_OF_ONE_VARIABLES are as they were before init_distributed set them."""
    before = {key: os.environ.get(key) for key, _ in WORLD_OF_ONE_VARIABLES}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def transformers_zero3_setting_restored() -> Iterator[None]:
    """The run's block, after which transformers' ZeRO-3 setting is the caller's again. A ZeRO-3 run's
    HfDeepSpeedConfig turns it on for as long as the object lives, and a run stopped by an error or Ctrl-C kept it
    alive in the traceback a notebook or REPL keeps: every later from_pretrained there loaded its model through
    ZeRO-3's partitioning (failing on LOCAL_RANK, or its weights partitioned away). Only transformers' private
    module variable holds the setting."""
    from transformers.integrations import deepspeed as hf_deepspeed

    before = hf_deepspeed._hf_deepspeed_config_weak_ref
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = before


def init_distributed(timeout_minutes: float) -> tuple[int, int]:
    """Start (or join) the process group: torchrun / the deepspeed launcher / Slurm set the env;
    a plain `python -m megadiff adapt` runs as a world of one. Returns (rank, world_size)."""
    import deepspeed
    import torch.distributed as dist

    without_launcher = "MASTER_PORT" not in os.environ
    for key, default in WORLD_OF_ONE_VARIABLES:
        os.environ.setdefault(key, default)
    skip_cpu_shm_comm_build()
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        # before any collective or zero.Init: each local rank owns its own device (modulo: where
        # Slurm binds one GPU to each task, that GPU is device 0 whatever the local rank)
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]) % get_accelerator().device_count())
    timeout = timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        _forget_an_earlier_groups_clone()
    if without_launcher and not dist.is_initialized():
        _form_world_of_one(get_accelerator().communication_backend_name(), timeout)
    deepspeed.init_distributed(auto_mpi_discovery=False, timeout=timeout)  # adopts a group formed already
    return dist.get_rank(), dist.get_world_size()


def _forget_an_earlier_groups_clone() -> None:
    """DeepSpeed clones the world group once per process, for its data-parallel collectives: once that group was
    destroyed (by a pre-training run's end, or parallel.shutdown(), in a notebook or sweep driver), the next
    adaptation in the process failed at its first broadcast ("Group ... is not registered"). Only DeepSpeed's
    private module variable holds the clone."""
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None


def _form_world_of_one(backend: str, timeout: timedelta) -> None:
    """A process group of one on an in-process store. Not a TCP store on a port seen free a moment before (torch's
    get_free_port): another program could take that port in between, and the run failed at its start with
    EADDRINUSE."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


@contextlib.contextmanager
def calibration_parameters(model: torch.nn.Module, stage: int, selection: str):
    """ZeRO-3 partitions the weights at load; head selection runs the whole model on every rank.

    Each block (embedding, every decoder layer, final norm, output layer) has its weights gathered
    just while it runs forward and, for importance, again just while its backward runs (module
    backward hooks, as DeepSpeed's own engine fetches them), so a device holds one block's weights
    at a time and models whose replica does not fit on one device can be measured. Autograd keeps
    the parameters themselves, not copies (DeepSpeed's ZeRO-3 linear saves its weight), so a block
    released after its forward computes its backward with the weights gathered again.
    """
    if stage != 3:
        yield
        return
    import deepspeed

    blocks = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    gathered: dict[torch.nn.Module, contextlib.AbstractContextManager] = {}

    def release(module, *_):
        if module in gathered:
            gathered.pop(module).__exit__(None, None, None)

    def gather(module, *_):
        # blocks never run nested: whatever is still gathered is done (the first layer's backward
        # stops at its gates, before its input, so its release hook never fires)
        for other in [m for m in gathered if m is not module]:
            release(other)
        if module not in gathered:
            gathered[module] = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
            gathered[module].__enter__()

    handles = []
    for block in blocks:
        handles += [block.register_forward_pre_hook(gather), block.register_forward_hook(release)]
        if selection == "importance":
            handles += [block.register_full_backward_pre_hook(gather), block.register_full_backward_hook(release)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in list(gathered):  # the last backward's first layer, or a failed pass
            release(module)
