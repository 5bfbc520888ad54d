"""What a training step reads back from the device, and how often: each read waits for the GPU, and a read per
layer or per parameter grows with the model. Counted on the CPU, where every tensor is a host tensor, by the
calls that read a tensor's values into Python; torch's optimizers keep their step counters on the host (those
reads never wait for a device) and are left out."""
from __future__ import annotations

import collections
import traceback

import pytest
import torch

from tests.distributed import run_ranks
from tests.parity_worker import MODEL, SEED, global_micro_batches

READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
HOST_SIDE_CALLERS = ("/torch/optim/",)  # Adam's step counters


class ReadCounter:
    """Counts, while `counting`, the calls of READS, by the line that made them."""

    def __init__(self):
        self.counting = False
        self._reading = False  # CPU mode's torch-function mode relays a read to the read itself: counted once
        self.sites = collections.Counter()
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}

    def __enter__(self) -> "ReadCounter":
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counted(original))
        return self

    def __exit__(self, *_) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            if self.counting and not self._reading:
                caller = _caller()
                if not any(part in caller for part in HOST_SIDE_CALLERS):
                    self.sites[caller] += 1
            reading, self._reading = self._reading, True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._reading = reading
        return read


def _caller() -> str:
    """The first frame outside this file and megadiff's CPU mode (whose torch-function mode relays each call)."""
    frames = [frame for frame in traceback.extract_stack()[:-2]
              if frame.filename != __file__ and "cpu_mode" not in frame.filename
              and "torch/overrides" not in frame.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}"


def _engine(overrides: list[str]):
    from megadiff.config import build_config
    from megadiff.parallel import initialize
    from megadiff.training.engine import build_engine

    cfg = build_config({}, MODEL + ["train.clip_grad=0.05"] + overrides, 1)
    initialize(cfg.parallel, SEED)
    return build_engine(cfg)


def _reads_of_a_step(overrides: list[str]) -> dict[str, int]:
    from megadiff.training.step import train_step

    engine = _engine(overrides)
    with ReadCounter() as counter:
        for step in range(2):  # the second step: the first builds what later ones reuse
            counter.counting = step == 1
            batches = global_micro_batches(engine.cfg, step)
            assert train_step(engine, iter(batches), len(batches)).updated
    return dict(counter.sites)


def _reads_worker(rank: int, world_size: int, overrides: list[str], out: str) -> None:
    from megadiff.parallel import shutdown

    reads = {layers: _reads_of_a_step(overrides + [f"model.num_layers={layers}"]) for layers in (2, 4)}
    shutdown()
    torch.save(reads, out)


@pytest.mark.parametrize("overrides", [["model.variant=diff"], ["model.variant=softmax", "train.precision=bf16"]],
                         ids=["diff_fp32", "softmax_bf16"])
def test_a_steps_device_reads_do_not_grow_with_the_model(tmp_path, overrides):
    out = str(tmp_path / "reads.pt")
    run_ranks(1, _reads_worker, overrides, out)
    reads = torch.load(out)
    assert reads[2] == reads[4], f"reads per step, 2 layers: {reads[2]}; 4 layers: {reads[4]}"
    assert sum(reads[4].values()) <= 3, reads[4]  # the loss; the gradient norm: its parameters' norms, then their total


def _curve_worker(rank: int, world_size: int, overrides: list[str], out: str) -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    from megadiff.parallel import shutdown
    from megadiff.training.step import train_step

    curves = {}
    for norm in ("megadiff", "megatron"):
        engine = _engine(overrides)
        if norm == "megatron":  # megatron's own fallback, as before megadiff replaced it
            clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
        steps = []
        for step in range(3):
            batches = global_micro_batches(engine.cfg, step)
            result = train_step(engine, iter(batches), len(batches))
            steps.append((result.loss, result.grad_norm))
        curves[norm] = (steps, [p.detach().clone() for chunk in engine.unwrapped() for p in chunk.parameters()])
    shutdown()
    torch.save(curves, out)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_gradient_norm_and_the_curve_are_megatrons_own_to_the_bit(tmp_path, precision):
    """Every step clipped (train.clip_grad=0.05), so the norm reaches the weights too."""
    out = str(tmp_path / "curves.pt")
    run_ranks(1, _curve_worker, ["model.variant=diff", f"train.precision={precision}"], out)
    curves = torch.load(out)
    (ours, our_params), (theirs, their_params) = curves["megadiff"], curves["megatron"]
    assert ours == theirs
    assert all(torch.equal(a, b) for a, b in zip(our_params, their_params))
