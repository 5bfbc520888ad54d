"""Loading into layers that keep `_extra_state` (TransformerEngine's FP8 scaling history) from a
checkpoint of megatron's local layers, which has none: the 4K run or a conversion continued with
`model.transformer_impl=te`. TransformerEngine cannot be installed here, so the differential core
attention is given the same kind of extra state a TE layer has; megatron checkpoints it as a
ShardedObject exactly as it does TE's."""
from __future__ import annotations

import contextlib
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


def test_a_checkpoint_lacking_a_tensor_other_than_extra_state_is_refused_naming_it(tmp_path, monkeypatch):
    """dist_checkpointing returns the requested keys a checkpoint lacks instead of failing: a weight left out
    would keep its fresh initialisation, silently; only TE's `_extra_state` may be absent."""
    from megadiff.checkpoint import weights
    from megadiff.checkpoint.format import CheckpointError

    absent = {"decoder.layers.self_attention.core_attention._extra_state", "decoder.final_layernorm.weight"}
    monkeypatch.setattr(weights.dist_checkpointing, "load", lambda request, path, strict: (request, None, absent))
    # no .metadata: megatron's load is mocked
    monkeypatch.setattr(weights, "metadata_read_once", lambda path: contextlib.nullcontext())
    (tmp_path / "common.pt").write_bytes(b"")  # the file load_sharded looks for before megatron reads it
    with pytest.raises(CheckpointError, match=r"lacks 1 saved tensors this run needs: decoder\.final_layernorm\."
                                              r"weight$"):
        weights.load_sharded({}, tmp_path)
    absent.discard("decoder.final_layernorm.weight")
    assert weights.load_sharded({"model": {}}, tmp_path) == {"model": {}}


def test_loaded_state_with_weights_the_model_lacks_or_lacking_its_weights_is_refused_naming_them():
    """load_state_dict(strict=False), as `_extra_state` needs: every other key it leaves out or cannot place
    must be refused by name (a layout or variant other than the model's)."""
    from megadiff.checkpoint.format import CheckpointError
    from megadiff.checkpoint.weights import load_into_chunks

    layer = torch.nn.Linear(2, 2)
    whole = {key: torch.zeros_like(value) for key, value in layer.state_dict().items()}
    load_into_chunks([layer], {"model": dict(whole)})
    assert all(torch.count_nonzero(p) == 0 for p in layer.parameters())
    with pytest.raises(CheckpointError, match="model does not match the checkpoint: extra"):
        load_into_chunks([layer], {"model": {**whole, "extra": torch.zeros(1)}})
    with pytest.raises(CheckpointError, match="model1 does not match the checkpoint: bias"):
        load_into_chunks([layer, layer], {"model0": whole, "model1": {"weight": whole["weight"]}})


def test_many_keys_are_named_five_and_counted():
    from megadiff.checkpoint.weights import _named

    keys = [f"decoder.layers.{i}.weight" for i in range(8)]
    assert _named(keys) == ", ".join(keys[:5]) + f" and {len(keys) - 5} more"
    assert _named(keys[:5]) == ", ".join(keys[:5])
