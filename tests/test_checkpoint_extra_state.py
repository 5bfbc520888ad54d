"""Loading into layers that keep `_extra_state` (TransformerEngine's FP8 scaling history) from a
checkpoint of megatron's local layers, which has none: the 4K run or a conversion continued with
`model.transformer_impl=te`. TransformerEngine cannot be installed here, so the differential core
attention is given the same kind of extra state a TE layer has; megatron checkpoints it as a
ShardedObject exactly as it does TE's."""
from __future__ import annotations

import json

import pytest
import torch

from megadiff.ops import depth_lambda_init
from tests.distributed import run_ranks

MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.vocab_size=256",
         "model.make_vocab_size_divisible_by=64", "model.seq_length=32"]


class ExtraStateProbe:
    """get/set_extra_state for a module class, recording what a load hands back."""

    def __init__(self):
        self.restored = []

    def install(self, cls) -> None:
        probe = self
        cls.get_extra_state = lambda module: torch.tensor([module.lambda_init], dtype=torch.float64)
        cls.set_extra_state = lambda module, state: probe.restored.append(float(state[0]))


def worker(rank: int, world_size: int, root: str) -> None:
    from megadiff.checkpoint.weights import load_model_weights, save_model_weights
    from megadiff.config import build_config
    from megadiff.models import build_model
    from megadiff.models.differential_attention import DifferentialCoreAttention
    from megadiff.parallel import initialize, set_seed, shutdown

    cfg = build_config({}, MODEL)
    initialize(cfg.parallel, seed=1)
    (local,) = build_model(cfg)
    save_model_weights([local], cfg, f"{root}/local")

    probe = ExtraStateProbe()
    probe.install(DifferentialCoreAttention)
    set_seed(2)  # other initial weights, so a load that left one out would show
    (with_extra,) = build_model(cfg)
    load_model_weights([with_extra], f"{root}/local")
    from_local = {"restored": list(probe.restored),
                  "mismatched": [name for name, p in with_extra.named_parameters()
                                 if not torch.equal(p, dict(local.named_parameters())[name])]}

    save_model_weights([with_extra], cfg, f"{root}/extra")
    probe.restored.clear()
    set_seed(3)
    (reloaded,) = build_model(cfg)
    load_model_weights([reloaded], f"{root}/extra")
    with open(f"{root}/result.json", "w") as f:
        json.dump({"from_local": from_local, "from_extra": {"restored": sorted(probe.restored)}}, f)
    shutdown()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("extra-state")
    run_ranks(1, worker, str(root))
    return json.loads((root / "result.json").read_text())


def test_layers_with_extra_state_load_a_checkpoint_without_it(result):
    assert result["from_local"]["mismatched"] == []   # every weight loaded
    assert result["from_local"]["restored"] == []     # nothing to restore: the layers start afresh


def test_saved_extra_state_is_restored(result):
    # each layer's own: its depth-dependent lambda_init
    assert result["from_extra"]["restored"] == pytest.approx([depth_lambda_init(0), depth_lambda_init(1)])
