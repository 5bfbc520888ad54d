"""Runs inside each rank: train a tiny model of every variant for a few steps, record
loss, full gradients and parameters, so the test can compare layouts with one process."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megadiff.checkpoint.gather import model_sharded_tensors
from tests.full_tensors import gather_full_tensors
from megadiff.config import build_config, data_parallel_size
from megadiff.parallel import initialize, shutdown
from megadiff.models.documents import document_cu_seqlens
from megadiff.training.engine import build_engine, build_optimizer
from megadiff.training.step import train_step

SEED = 1234
MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=96", "model.vocab_size=200", "model.make_vocab_size_divisible_by=64",
         "model.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=8", "train.lr=0.01",
         "train.weight_decay=0.01", "train.clip_grad=1.0", "train.adam_eps=1e-4", "model.attention_backend=sdpa"]
VARIANTS = {
    "softmax": ["model.variant=softmax"],
    "diff": ["model.variant=diff"],
    "dint": ["model.variant=dint"],
    # non-zero low-rank updates so every factor gets a gradient
    "shared_diff": ["model.variant=shared_diff", "model.lowrank_rank=4", "model.lowrank_zero_init=false"],
}
LAYOUTS = {
    "single": (1, []),
    "tp2": (2, ["parallel.tensor=2"]),
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "pp2_interleaved": (2, ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
    "tp2_pp2": (4, ["parallel.tensor=2", "parallel.pipeline=2"]),
    "cp2": (2, ["parallel.context=2"]),
    # DP x CP: the loss and DINT's carries reduce over CP alone, the gradients over DP x CP (with DP 1 the
    # groups coincide, and a collective on the wrong one went unseen)
    "dp2_cp2": (4, ["parallel.context=2"]),
    # the distributed optimizer shards over DP x CP (here CP alone), overlapping its gradient reduce and
    # parameter gather with the interleaved schedule's model chunks
    "cp2_pp2_interleaved_distopt_overlap": (4, ["parallel.context=2", "parallel.pipeline=2",
                                                "parallel.virtual_pipeline=2", "parallel.distributed_optimizer=true",
                                                "parallel.overlap_grad_reduce=true",
                                                "parallel.overlap_param_gather=true"]),
    # document masking: the boundaries reach every pipeline stage's layers (every model chunk of the
    # interleaved schedule, recomputed layers too), SP gathers whole sequences, CP ranks attend from their
    # chunks within documents and carry DINT's mean across them
    "single_documents": (1, ["data.document_masking=true"]),
    "tp2_sp_pp2_documents": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
                                 "parallel.virtual_pipeline=2", "data.document_masking=true",
                                 "train.recompute=full"]),
    "cp2_documents": (2, ["parallel.context=2", "data.document_masking=true"]),
    "cp4_documents": (4, ["parallel.context=4", "data.document_masking=true"]),
    "dp2_cp2_documents": (4, ["parallel.context=2", "data.document_masking=true"]),
    # CP ranks gather each TP rank's heads of the SP-gathered sequence chunks
    "tp2_sp_cp2_documents": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=2",
                                 "data.document_masking=true"]),
}
EOD = 0
# documents [0, 4), [4, 9), [9, 16) and [0, 6), [6, 16): under CP=2 (chunks of 4) and CP=4 (chunks of 2)
# some start at a chunk's start, some inside a chunk, and they run across one or several chunk ends
EOD_POSITIONS = ([3, 8], [5])


def layout_independent_weights(chunks: list, seed: int) -> None:
    """Every global tensor drawn from a generator seeded by its key: identical for any layout."""
    with torch.no_grad():
        for shard in model_sharded_tensors(chunks):
            key = shard.key
            gen = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
            full = torch.randn(shard.global_shape, generator=gen)
            if key.endswith(("layernorm.weight", "norm_weight")):
                full = 1.0 + 0.1 * full
            else:
                full = 0.1 * full if "lambda_" in key else 0.05 * full
            shard.data.copy_(full[shard.global_slice()])


def global_micro_batches(cfg, seed_offset: int) -> list[dict]:
    gen = torch.Generator().manual_seed(SEED + seed_offset)
    count = cfg.train.global_batch_size // cfg.train.micro_batch_size
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length + 1),
                               generator=gen)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            position_ids=torch.arange(cfg.model.seq_length).expand(cfg.train.micro_batch_size, -1),
                            loss_mask=(torch.rand(tokens[:, 1:].shape, generator=gen) > 0.1).float()))
        if cfg.data.document_masking:
            batch = batches[-1]
            for row, positions in zip(batch["tokens"], EOD_POSITIONS):
                row[positions] = EOD
            batch["cu_seqlens"] = document_cu_seqlens(batch["tokens"], EOD)
    return batches


def full_gradients(engine) -> dict[str, torch.Tensor]:
    """Reduced gradients as full tensors; with the distributed optimizer each DP x CP rank owns a slice."""
    params = [p for chunk in engine.unwrapped() for p in chunk.parameters()]
    if engine.cfg.parallel.distributed_optimizer:
        owners = engine.optimizer.chained_optimizers
        for param in params:  # every rank joins every all-reduce, owner of a slice or not
            grad = torch.zeros_like(param.main_grad).view(-1)
            for inner in owners:
                if param in inner.model_param_gbuf_map:
                    owned = inner._get_model_param_range_map(param)["param"]
                    grad[owned.start:owned.end] = param.main_grad.view(-1)[owned.start:owned.end]
            # megatron shards the gradient buffers over the data- and context-parallel ranks together
            dist.all_reduce(grad, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            param.main_grad.copy_(grad.view_as(param.main_grad))
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param in params:
            param.copy_(param.main_grad)
    grads, _ = gather_full_tensors(engine.unwrapped())
    with torch.no_grad():
        for param, original in zip(params, saved):
            param.copy_(original)
    return grads


def run_layout(rank: int, world_size: int, layout: str, out_path: str, steps: int, break_replicated_grads: bool):
    if break_replicated_grads:  # negative control: drop the TP sum of lambda / head-norm gradients
        import megadiff.training.engine as engine_module
        engine_module.sum_partial_gradients = lambda model_chunks: None
    results = {}
    _, overrides = LAYOUTS[layout]
    for variant, variant_overrides in VARIANTS.items():
        cfg = build_config({}, MODEL + variant_overrides + overrides, world_size)
        initialize(cfg.parallel, SEED)
        engine = build_engine(cfg)
        layout_independent_weights(engine.unwrapped(), SEED)
        engine.optimizer = build_optimizer(cfg, engine.config, engine.model)  # its fp32 copies see the new weights
        dp, dp_rank = data_parallel_size(cfg.parallel, world_size), parallel_state.get_data_parallel_rank()
        record = {"losses": []}
        for step in range(steps):
            mine = global_micro_batches(cfg, 0)[dp_rank::dp]  # the same data each step: the loss must fall
            iterators = [iter(mine) for _ in engine.model]
            hook = (lambda e: record.update(grads=full_gradients(e))) if step == 0 else None
            result = train_step(engine, iterators if len(iterators) > 1 else iterators[0], len(mine), hook)
            record["losses"].append(result.loss)
        engine.gather_updated_params()  # overlap_param_gather leaves the last step's all-gather to a next forward
        record["params"], record["replica_diff"] = gather_full_tensors(engine.unwrapped())
        results[variant] = record
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    shutdown()
