"""Every parallel layout reproduces the single-process run: loss, every gradient, and the
parameters after a few optimizer steps, for all four attention variants in every layout."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.parity_worker import LAYOUTS, VARIANTS, run_layout

STEPS = 3


def _run(tmp_dir, layout: str, break_replicated_grads: bool = False) -> dict:
    out = tmp_dir / f"{layout}{'-broken' if break_replicated_grads else ''}.pt"
    world_size, _ = LAYOUTS[layout]
    run_ranks(world_size, run_layout, layout, str(out), STEPS, break_replicated_grads)
    return torch.load(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("parity"), "single")


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _compare(single: dict, other: dict, variant: str) -> None:
    ref, got = single[variant], other[variant]
    assert got["losses"] == pytest.approx(ref["losses"], abs=2e-6), f"{variant}: losses differ"
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in ref["grads"].items():
        assert grad.abs().max() > 0, f"{variant}: {key} has no gradient in the reference"
        assert _max_rel_diff(got["grads"][key], grad) < 1e-4, f"{variant}: gradient of {key} differs"
    for key, param in ref["params"].items():
        assert _max_rel_diff(got["params"][key], param) < 1e-4, f"{variant}: {key} differs after {STEPS} steps"
    diverged = {k: v for k, v in got["replica_diff"].items() if v > 1e-6}
    assert not diverged, f"{variant}: replicated parameters diverged across ranks: {diverged}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single" and "documents" not in name])
def test_layout_matches_single_process(layout, single, tmp_path):
    other = _run(tmp_path, layout)
    assert set(other) == set(VARIANTS)
    for variant in other:
        _compare(single, other, variant)


@pytest.fixture(scope="module")
def single_documents(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("parity-documents"), "single_documents")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_sp_pp2_documents", "cp2_documents", "cp4_documents", "dp2_cp2_documents",
                                    "tp2_sp_cp2_documents"])
def test_document_masking_layout_matches_single_process(layout, single_documents, tmp_path):
    """Layouts with document masking against one process with it (that the masking changes the
    model's output: tests/test_document_masking.py)."""
    other = _run(tmp_path, layout)
    assert set(other) == set(VARIANTS)
    for variant in other:
        _compare(single_documents, other, variant)


@pytest.mark.slow
def test_losses_fall_in_single_process(single):
    for variant, record in single.items():
        assert record["losses"][-1] < record["losses"][0], variant


@pytest.mark.slow
def test_without_lambda_grad_allreduce_tensor_parallel_ranks_diverge(single, tmp_path):
    """Negative control: the check above catches a missing TP all-reduce of replicated grads."""
    broken = _run(tmp_path, "tp2", break_replicated_grads=True)
    lambda_keys = [k for k in broken["diff"]["replica_diff"] if "lambda_" in k or "norm_weight" in k]
    assert lambda_keys
    assert max(broken["diff"]["replica_diff"][k] for k in lambda_keys) > 1e-6
