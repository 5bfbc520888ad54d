"""What one iteration achieved: tokens/s, TFLOP/s per device and MFU, and each layer's lambda."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megadiff.config import Config
from megadiff.models.param_count import training_flops_per_token

# dense bf16 tensor-core peaks (TFLOP/s) used for MFU when logging.peak_tflops is not set; the most
# specific name in the device's name wins ("NVIDIA GB200" holds "B200", "NVIDIA H100 PCIe" "H100")
# "NVIDIA H200 NVL" holds "H200" and "NVIDIA H800 PCIe" "H800", yet they peak as the H100 NVL and PCIe do
KNOWN_PEAK_TFLOPS = {"H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0, "H200 NVL": 835.0,
                     "H800": 989.0, "H800 PCIe": 756.0, "A100": 312.0, "B200": 2250.0, "GB200": 2500.0}


def device_peak_tflops(configured: float | None) -> float | None:
    if configured is not None:
        return configured
    if not torch.cuda.is_available():
        return None
    return peak_tflops_of(torch.cuda.get_device_name())


def peak_tflops_of(device_name: str) -> float | None:
    matches = [key for key in KNOWN_PEAK_TFLOPS if key in device_name]
    return KNOWN_PEAK_TFLOPS[max(matches, key=len)] if matches else None


class Throughput:
    def __init__(self, cfg: Config, world_size: int):
        self.tokens_per_iteration = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_iteration = (training_flops_per_token(cfg.model, tensor_parallel=cfg.parallel.tensor)
                                    * self.tokens_per_iteration)
        self.world_size = world_size
        self.peak = device_peak_tflops(cfg.logging.peak_tflops)

    def measure_peaks_from_here(self) -> None:
        """The high-water marks from the first step on: the start-up's transients are no training's memory (a
        checkpoint's load holds its loaded optimizer state and weights beside the optimizer's own a moment,
        which a resumed run's records all reported as their peak)."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def metrics(self, seconds: float) -> dict:
        tflops = self.flops_per_iteration / seconds / self.world_size / 1e12
        record = {"iteration_time_ms": 1000 * seconds, "tokens_per_s": self.tokens_per_iteration / seconds,
                  "tflops_per_device": tflops}
        if self.peak:
            record["mfu"] = tflops / self.peak
        if torch.cuda.is_available():
            record.update(_high_water_marks_gib())
        return record


def _high_water_marks_gib() -> dict[str, float]:
    """The most loaded rank's allocated and reserved peaks since the run's first step (pipeline
    stages and the vocabulary's ranks differ). Collective: every rank logs the same iterations."""
    marks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                         dtype=torch.float64, device="cuda")
    if dist.is_initialized():
        dist.all_reduce(marks, op=dist.ReduceOp.MAX)
    allocated, reserved = (float(mark) / 2 ** 30 for mark in marks)
    return {"max_memory_allocated_gib": allocated, "max_memory_reserved_gib": reserved}


def layer_lambdas(chunks: list) -> dict[str, float]:
    """{"layer_<global 1-based number>": lambda} for every differential layer of the whole model, as
    its last forward (the logged iteration's) used it.

    Collective over the pipeline group: each stage holds its own layers.
    """
    used = {f"layer_{layer.layer_number}": layer.self_attention.core_attention.last_lambda
            for chunk in chunks for layer in chunk.decoder.layers
            if getattr(layer.self_attention.core_attention, "last_lambda", None) is not None}
    # one host synchronisation for all layers
    local = dict(zip(used, torch.stack(list(used.values())).float().tolist())) if used else {}
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return local
    stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, local, group=parallel_state.get_pipeline_model_parallel_group())
    merged = {key: value for stage in stages for key, value in stage.items()}
    return dict(sorted(merged.items(), key=lambda item: int(item[0].split("_")[1])))
