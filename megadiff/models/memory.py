"""Memory per GPU from the config alone: the model states (weights, gradients and optimizer state
on the most loaded rank of a layout, as megadiff's engine allocates them: megatron DDP with fp32
gradient buffers, megatron's Adam with fp32 main parameters in mixed precision), and the
activations saved for backward (models/activation_memory.py).

Neither counts the allocator's caching and fragmentation, communication buffers or the
backward's transients; a short run's `max_memory_allocated_gib` (metrics.jsonl) or a memory
profile (`logging.profile_memory`) measures those.
"""
from __future__ import annotations

from dataclasses import dataclass

from megadiff.config import Config, ConfigError, data_parallel_size
from megadiff.models.activation_memory import ActivationMemory, NotEstimated, activation_memory
from megadiff.models.param_count import ParamCount, count_parameters

GIB = 1024 ** 3


@dataclass(frozen=True)
class ModelStateMemory:
    parameters: int   # on the most loaded rank
    weights: int      # bytes
    gradients: int
    optimizer: int
    optimizer_shards: int  # ranks one optimizer state is split over (1 without the distributed optimizer)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def stage_parameters(counts: ParamCount, tensor: int, pipeline: int) -> list[int]:
    """Parameters one rank of each pipeline stage holds: its layers' (split over tensor-parallel
    ranks, but for the norms and the replicated attention pieces), the first stage's embedding,
    the last stage's final norm and output layer (a copy of the embedding when tied across stages)."""
    split = counts.attention - counts.attention_replicated + counts.mlp
    per_layer = split // tensor + counts.attention_replicated + counts.norms
    layers = counts.num_layers // pipeline * per_layer
    embedding = counts.embedding // tensor
    output = (counts.output_layer or (counts.embedding if pipeline > 1 else 0)) // tensor
    if pipeline == 1:
        return [layers + embedding + output + counts.final_norm]
    return [layers + embedding] + [layers] * (pipeline - 2) + [layers + output + counts.final_norm]


def model_state_memory(cfg: Config, world_size: int) -> ModelStateMemory:
    parallel, precision = cfg.parallel, cfg.train.precision
    counts = count_parameters(cfg.model, parallel.tensor)
    parameters = max(stage_parameters(counts, parallel.tensor, parallel.pipeline))
    mixed = precision != "fp32"
    # the distributed optimizer splits its state over the data- and context-parallel ranks
    shards = data_parallel_size(parallel, world_size) * parallel.context if parallel.distributed_optimizer else 1
    # Adam's two moments, plus fp32 main copies of the (bf16/fp16) weights in mixed precision
    optimizer_bytes = (12 if mixed else 8) * parameters
    return ModelStateMemory(parameters=parameters, weights=(2 if mixed else 4) * parameters,
                            gradients=4 * parameters,  # fp32 gradient buffers (grad_reduce_in_fp32)
                            optimizer=-(-optimizer_bytes // shards), optimizer_shards=shards)


def estimate_activations(cfg: Config, world_size: int, device: str = "cuda") -> ActivationMemory | str:
    """The activation estimate, or why there is none."""
    try:
        return activation_memory(cfg, world_size, device)
    except NotEstimated as reason:
        return f"not estimated: {reason}"


def describe_activations(activations: ActivationMemory) -> str:
    parts = [f"{activations.per_layer / GIB:.3f} GiB per layer x {activations.layers} layers in flight"]
    if activations.output:
        parts.append(f"{activations.output / GIB:.2f} GiB output layer and loss")
    if activations.rebuilt:
        parts.append(f"{activations.rebuilt / GIB:.2f} GiB for the layer rebuilt in backward")
    return f"{activations.total / GIB:.2f} GiB ({', '.join(parts)})"


def describe(memory: ModelStateMemory, activations: ActivationMemory | str) -> list[tuple[str, str]]:
    """Rows for `megadiff params`."""
    sharded = f", split over {memory.optimizer_shards} ranks" if memory.optimizer_shards > 1 else ""
    rows = [("parameters", f"{memory.parameters:,}"),
            ("weights", f"{memory.weights / GIB:.2f} GiB"),
            ("gradients", f"{memory.gradients / GIB:.2f} GiB (fp32)"),
            ("optimizer", f"{memory.optimizer / GIB:.2f} GiB (Adam{sharded})"),
            ("model states", f"{memory.total / GIB:.2f} GiB, before activations")]
    if isinstance(activations, str):
        return rows + [("activations", activations)]
    return rows + [("activations", describe_activations(activations)),
                   ("peak estimate", f"{(memory.total + activations.total) / GIB:.2f} GiB")]


def check_fits(memory: ModelStateMemory, device_bytes: int) -> None:
    """Refuse a layout whose model states alone exceed the device: it could only run out of memory,
    after the data indices and the model were built."""
    if memory.total > device_bytes:
        raise ConfigError(
            f"parallel: the most loaded GPU needs {memory.total / GIB:.1f} GiB for its weights, gradients and "
            f"optimizer state alone ({memory.parameters:,} parameters), more than its {device_bytes / GIB:.1f} GiB; "
            "raise parallel.tensor or parallel.pipeline, or set parallel.distributed_optimizer=true "
            "(`megadiff params --world-size N CONFIG` shows the effect of each)")


def activations_warning(memory: ModelStateMemory, activations: ActivationMemory | str, device_bytes: int) -> str | None:
    """A layout whose model states fit but whose estimated activations push the peak past the device
    is only warned about: the estimate leaves out the allocator's own overheads, and a first step
    settles it."""
    if isinstance(activations, str):
        return None
    peak = memory.total + activations.total
    if peak <= device_bytes:
        return None
    return (f"warning: the most loaded GPU is estimated to need {peak / GIB:.1f} GiB "
            f"({memory.total / GIB:.1f} model states + {activations.total / GIB:.1f} activations), more than its "
            f"{device_bytes / GIB:.1f} GiB; train.recompute=selective or full, a larger parallel.tensor (with "
            "sequence_parallel) or parallel.context, or a smaller train.micro_batch_size saves activations")
