"""Which tensor/pipeline/recompute layouts of a config fit a GPU, from the memory estimates alone.

`megadiff params --world-size N --fit GIB CONFIG` lists them: tensor parallelism within a node
(1, 2, 4, 8; sequence-parallel above 1), pipeline stages dividing the layers, and each recompute
mode, with the rest of the config (context parallelism, micro-batch, distributed optimizer) as
given. For each tensor x pipeline split only the least recomputation that fits; cheapest first:
the fewest model-parallel ranks, then the least recomputation, the order throughput usually
falls in.
"""
from __future__ import annotations

from dataclasses import dataclass

from megadiff.config import Config, ConfigError, load_config
from megadiff.models.activation_memory import ActivationMemory, activation_memory
from megadiff.models.memory import ModelStateMemory, model_state_memory

TENSOR_SIZES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tensor: int
    pipeline: int
    recompute: str
    model_states: ModelStateMemory
    activations: ActivationMemory

    @property
    def peak(self) -> int:
        return self.model_states.total + self.activations.total


def _candidate(config_path: str, overrides: list[str], world_size: int, tensor: int, pipeline: int,
               recompute: str) -> Config | None:
    layout = [f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}", "parallel.virtual_pipeline=null",
              f"parallel.sequence_parallel={str(tensor > 1).lower()}", f"train.recompute={recompute}"]
    try:
        return load_config(config_path, [*overrides, *layout], world_size=world_size)
    except ConfigError:  # heads, layers or batch sizes that this layout does not divide
        return None


def fitting_layouts(config_path: str, overrides: list[str], world_size: int, device_bytes: int) -> list[Layout]:
    """Raises NotEstimated for an attention backend whose activations are not modelled."""
    base = load_config(config_path, overrides, world_size=world_size)
    layouts = []
    for tensor in TENSOR_SIZES:
        for pipeline in range(1, base.model.num_layers + 1):
            if base.model.num_layers % pipeline or world_size % (tensor * pipeline * base.parallel.context):
                continue
            for recompute in RECOMPUTE:
                cfg = _candidate(config_path, overrides, world_size, tensor, pipeline, recompute)
                if cfg is None:
                    break  # the split itself is invalid, whatever the recomputation
                layout = Layout(tensor, pipeline, recompute, model_state_memory(cfg, world_size),
                                activation_memory(cfg, world_size))
                if layout.peak <= device_bytes:
                    layouts.append(layout)
                    break
    return sorted(layouts, key=lambda layout: (layout.tensor * layout.pipeline, RECOMPUTE.index(layout.recompute),
                                               layout.pipeline))
