"""The TransformerEngine backend: same numbers as the local backend on the same weights.
TransformerEngine cannot be installed on the CPU CI machines; these run where it is."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
if not torch.cuda.is_available():
    pytest.skip("TransformerEngine needs CUDA", allow_module_level=True)

from megadiff.checkpoint.gather import model_sharded_tensors  # noqa: E402
from tests.full_tensors import gather_full_tensors  # noqa: E402
from megadiff.config import build_config  # noqa: E402
from megadiff.models import build_model  # noqa: E402
from megadiff.parallel import initialize  # noqa: E402

MODEL = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4", "model.vocab_size=512",
         "model.seq_length=128", "train.precision=bf16"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["diff", "dint", "shared_diff"])
def test_te_backend_matches_local(variant, tmp_path):
    extra = ["model.lowrank_rank=8"] if variant == "shared_diff" else []
    local_cfg = build_config({}, MODEL + extra + [f"model.variant={variant}"])
    initialize(local_cfg.parallel, seed=3)
    (local,) = build_model(local_cfg)
    (te,) = build_model(build_config({}, MODEL + extra + [f"model.variant={variant}", "model.transformer_impl=te"]))
    weights, _ = gather_full_tensors([local])
    te_shards = model_sharded_tensors([te])
    # same checkpoint keys (megatron maps TE's fused norms): checkpoints move between backends
    assert {shard.key for shard in te_shards} == set(weights)
    with torch.no_grad():
        for shard in te_shards:
            shard.data.copy_(weights[shard.key][shard.global_slice()])
    tokens = torch.randint(0, 512, (2, 128), device="cuda")
    positions = torch.arange(128, device="cuda").expand(2, -1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = local.cuda()(tokens, positions, None)
        got = te.cuda()(tokens, positions, None)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
