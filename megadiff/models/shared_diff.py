"""Shared DIFF's QKV projection: shared W_Q, W_K plus four low-rank updates.

It stands in for megatron's `linear_qkv` and returns exactly the tensor that
a DIFF layer's fused QKV projection returns (see transformer_config.py), so
the rest of megatron's SelfAttention and DifferentialCoreAttention are reused:
    Q1 = X (W_Q + A_q1 B_q1^T), Q2 = X (W_Q + A_q2 B_q2^T), likewise K1, K2.
A (D x r, replicated across tensor-parallel ranks) and B (rows per head,
split across ranks with the heads) follow SPEC section 2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear, copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide, get_pg_size

UPDATES = ("q1", "q2", "k1", "k2")


class SharedDiffQKV(MegatronModule):
    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool = False,
                 bias: bool = False, tp_group=None, **_unused):
        super().__init__(config=config)
        if bias or gather_output:
            raise ValueError("Shared DIFF's QKV projection has no bias and keeps its output split")
        d, rank = config.kv_channels, config.lowrank_rank
        heads, kv_heads = config.differential_heads, config.differential_kv_heads
        tp = get_pg_size(tp_group)
        self.head_dim, self.rank = d, rank
        self.heads_per_group = heads // kv_heads
        self.kv_heads_local = divide(kv_heads, tp)
        # One row block per key/value group: [its query heads | K | V (2d)], so a contiguous
        # tensor-parallel split hands every rank whole groups.
        self.shared = ColumnParallelLinear(
            input_size, kv_heads * (self.heads_per_group * d + 3 * d), config=config, init_method=init_method,
            bias=False, gather_output=False, tp_group=tp_group)
        self.lowrank_down = torch.nn.Parameter(torch.empty(len(UPDATES) * rank, input_size, dtype=config.params_dtype))
        with torch.no_grad():
            self.lowrank_down.normal_(0.0, config.init_method_std)
        # replicated across TP ranks; under SP each rank sees only its tokens, so megatron's
        # finalize_model_grads must all-reduce its gradient, as for the norms
        setattr(self.lowrank_down, "sequence_parallel", config.sequence_parallel)
        up_init = torch.nn.init.zeros_ if config.lowrank_zero_init else init_method
        # direct children (not a ModuleDict) so megatron's sharded_state_dict sees them as TP-split
        for name in UPDATES:
            setattr(self, f"lowrank_up_{name}", ColumnParallelLinear(
                rank, (heads if name.startswith("q") else kv_heads) * d, config=config, init_method=up_init,
                bias=False, gather_output=False, tp_group=tp_group))
        assert output_size == 2 * heads * d + 4 * kv_heads * d, "unexpected DIFF QKV width"

    def _whole_down_projection(self, x: torch.Tensor) -> torch.Tensor:
        """X A of every token on every tensor-parallel rank, gathered once for the four up-projections (under
        SP from the ranks' token shards); its backward reduces the ranks' gradients, so A's gradient is
        complete per token shard."""
        down = F.linear(x, self.lowrank_down)
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(down, tensor_parallel_output_grad=True,
                                                        group=self.shared.tp_group)
        return copy_to_tensor_model_parallel_region(down, group=self.shared.tp_group)

    def forward(self, x: torch.Tensor):
        shared, _ = self.shared(x)
        seq, batch = shared.shape[:2]
        d, groups = self.head_dim, self.kv_heads_local
        shared = shared.view(seq, batch, groups, self.heads_per_group * d + 3 * d)
        q, k, v = torch.split(shared, [self.heads_per_group * d, d, 2 * d], dim=-1)
        down = self._whole_down_projection(x).split(self.rank, dim=-1)
        # the up-projections' own forwards would each gather (and reduce the gradient of) their part again
        update = {name: F.linear(part, getattr(self, f"lowrank_up_{name}").weight) for name, part in zip(UPDATES, down)}
        q = q.reshape(seq, batch, groups, self.heads_per_group, d)
        q1 = q + update["q1"].view_as(q)
        q2 = q + update["q2"].view_as(q)
        k1 = k + update["k1"].view_as(k)
        k2 = k + update["k2"].view_as(k)
        # megatron's DIFF layout: 2 * groups megatron groups, query heads interleaved (Q1_i, Q2_i)
        queries = torch.stack([q1, q2], dim=-2).reshape(seq, batch, 2 * groups, self.heads_per_group, d)
        keys = torch.stack([k1, k2], dim=-2).reshape(seq, batch, 2 * groups, 1, d)
        values = v.reshape(seq, batch, 2 * groups, 1, d)
        return torch.cat([queries, keys, values], dim=-2).reshape(seq, batch, -1), None

