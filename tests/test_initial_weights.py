"""train.layout_invariant_init: a fresh model's weights are the same, bit for bit, in every parallel layout, so
the first step's loss is too; megatron's own initialisation (the default) seeds each pipeline stage apart."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.initial_weights_worker import INITIALISED, initial_weights_and_first_loss
from tests.parity_worker import LAYOUTS

LAYOUTS_COMPARED = ["tp2", "pp2", "pp2_interleaved"]


def _initial(tmp_path_factory, layout: str, invariant: bool) -> dict:
    out = tmp_path_factory.mktemp("init") / f"{layout}-{invariant}.pt"
    run_ranks(LAYOUTS[layout][0], initial_weights_and_first_loss, layout, invariant, str(out))
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _initial(tmp_path_factory, "single", True)


@pytest.fixture(scope="module")
def single_default(tmp_path_factory):
    return _initial(tmp_path_factory, "single", False)


def _differing(ref: dict, got: dict) -> list[str]:
    return [key for key in ref["weights"] if not torch.equal(ref["weights"][key], got["weights"][key])]


@pytest.mark.parametrize("layout", LAYOUTS_COMPARED)
def test_initial_weights_and_first_loss_are_the_same_in_every_layout(layout, single, tmp_path_factory):
    other = _initial(tmp_path_factory, layout, True)
    for variant in INITIALISED:
        assert not _differing(single[variant], other[variant]), f"{variant}: initial weights differ under {layout}"
        assert other[variant]["loss"] == pytest.approx(single[variant]["loss"], abs=2e-6), variant


def test_default_initialisation_differs_per_pipeline_stage(single_default, tmp_path_factory):
    """The negative control, and the reason for the key: megatron's seeds, train.seed + 100 x stage."""
    other = _initial(tmp_path_factory, "pp2", False)
    assert all(_differing(single_default[variant], other[variant]) for variant in INITIALISED)


def test_redrawn_weights_follow_the_default_initialisation(single, single_default):
    """Same distributions as megatron's and megadiff's own init, constants kept. The ratio of two sample stds of
    n values each varies by about 1/sqrt(n): 4 of those allowed (a wrong init, e.g. linear_proj's depth-scaled
    std swapped with the plain one, a factor 2.8 here, fails on every matrix)."""
    for variant in INITIALISED:
        for key, default in single_default[variant]["weights"].items():
            redrawn = single[variant]["weights"][key]
            if default.std() == 0:
                assert torch.equal(redrawn, default), f"{variant}: {key}"
            else:
                allowed = 4 / default.numel() ** 0.5
                assert float(redrawn.std() / default.std()) == pytest.approx(1.0, abs=allowed), f"{variant}: {key}"
