"""Runs inside each rank: build the training engine of a layout, take one step, and measure what
the process holds: parameters per rank, and the bytes of every live tensor."""
from __future__ import annotations

import gc
import warnings

import torch
import torch.distributed as dist

from megadiff.config import build_config
from megadiff.parallel import compute_device, initialize, shutdown
from megadiff.training.engine import build_engine
from megadiff.training.step import train_step

MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.ffn_hidden_size=512",
         "model.vocab_size=4000", "model.seq_length=16", "train.micro_batch_size=1", "train.global_batch_size=2",
         "model.attention_backend=sdpa"]


def live_tensor_bytes() -> int:
    """Bytes of the storages behind every tensor the garbage collector can reach, memory shared by several
    storages (a tensor made over another's bytes) counted once."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a wrapper of no storage of its own (torch's ShardedTensor)
            continue  # its shards are counted
        if storage.device.type != "meta":  # shapes only
            storages[address] = max(storages.get(address, 0), storage.nbytes())
    return _covered_bytes(sorted(storages.items()))


def _covered_bytes(ranges: list[tuple[int, int]]) -> int:
    """The bytes of the union of the (start, length) ranges, sorted by start."""
    covered, end = 0, 0
    for start, length in ranges:
        covered += max(0, start + length - max(start, end))
        end = max(end, start + length)
    return covered


def tensor_bytes_after(owner, name: str, monkeypatch) -> list[int]:
    """Patches `owner`'s function `name` to record the bytes of every live tensor as each call returns."""
    held, original = [], getattr(owner, name)

    def measuring(*args, **kwargs):
        result = original(*args, **kwargs)
        held.append(live_tensor_bytes())
        return result
    monkeypatch.setattr(owner, name, measuring)
    return held


def measure(rank: int, world_size: int, overrides: list[str], results) -> None:
    cfg = build_config({}, MODEL + overrides, world_size)
    initialize(cfg.parallel, seed=1)
    before = live_tensor_bytes()
    engine = build_engine(cfg)
    micro_batches = 2 // (world_size // (cfg.parallel.tensor * cfg.parallel.pipeline))
    batch = {"tokens": torch.randint(0, 4000, (1, 16)), "labels": torch.randint(0, 4000, (1, 16)),
             "loss_mask": torch.ones(1, 16), "position_ids": torch.arange(16)[None]}
    train_step(engine, iter([batch] * micro_batches), micro_batches)
    row = torch.tensor([sum(p.numel() for chunk in engine.unwrapped() for p in chunk.parameters()),
                        live_tensor_bytes() - before], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row)
    if rank == 0:
        results.put([r.tolist() for r in rows])
    shutdown()


class _Saved:
    """What autograd keeps for one saved tensor; releases its storage's count when the graph drops it."""

    def __init__(self, tracker: "SavedActivations", tensor: torch.Tensor, key: int | None):
        self.tracker, self.tensor, self.key = tracker, tensor, key

    def __del__(self):
        if self.key is not None:
            self.tracker.release(self.key)


class SavedActivations:
    """Peak bytes of the storages autograd holds for backward at once, parameters excluded: the
    activation memory that models/activation_memory.py estimates."""

    def __init__(self, parameters):
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, saved tensors using it]
        self.current = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters or storage.nbytes() == 0:
            return _Saved(self, tensor, None)
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Saved(self, tensor, key)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved.tensor)


def measure_activations(rank: int, world_size: int, overrides: list[str], results) -> None:
    """Peak saved activations of one training step on each rank (one row per rank, to rank 0)."""
    cfg = build_config({}, MODEL + overrides, world_size)
    initialize(cfg.parallel, seed=1)
    engine = build_engine(cfg)
    seq, micro = cfg.model.seq_length, cfg.train.micro_batch_size
    dp = world_size // (cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.context)
    micro_batches = cfg.train.global_batch_size // (micro * dp)
    batch = {"tokens": torch.randint(0, 4000, (micro, seq)), "labels": torch.randint(0, 4000, (micro, seq)),
             "loss_mask": torch.ones(micro, seq), "position_ids": torch.arange(seq).expand(micro, seq)}
    batch = {key: value.to(compute_device()) for key, value in batch.items()}
    tracker = SavedActivations(p for chunk in engine.model for p in chunk.parameters())
    with tracker.hooks():  # one iterator per model chunk (interleaved pipelines)
        train_step(engine, [iter([batch] * micro_batches) for _ in engine.model], micro_batches)
    peaks = torch.tensor([float(tracker.peak)], dtype=torch.float64, device=compute_device())
    rows = [torch.zeros_like(peaks) for _ in range(world_size)]
    dist.all_gather(rows, peaks)
    if rank == 0:
        results.put([float(r) for r in rows])
    shutdown()
