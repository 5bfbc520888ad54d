"""Incremental decoding of a single-process GPTModel: the keys and values of the positions already
run stay in megatron's StaticInferenceContext, so a new token costs one position's forward pass.

megatron's attention writes each call's keys and values into the context's buffers and hands the
core attention every key so far (our core attentions mask causally, bottom-right aligned, so a
call's queries see the cached positions and each other causally). The DINT integral also needs the
sum of the first map's outputs over the cached positions: an IntegralCarry per layer, attached to
its core attention while the cache runs.

The buffers hold what the calls so far need, not `max_length` up front: a converted Llama 3.1's window of
131072 positions is 17 GB of keys and values for an 8B model, whatever the prompt (a conversation, an
in-context prompt). A call that would overflow them moves them into buffers of twice their length (or of
what the call needs, when more), never past `max_length`, as transformers' DynamicCache grows by each call.

A cache can also go back to an earlier length (truncate), e.g. to a conversation's prefix that the
next prompt shares: the keys and values beyond it are simply overwritten later; DINT's running sum
is known only where a call ended, so a `rewindable` cache keeps a snapshot of it there: at every
call end among the last CALL_END_SPACING positions, and one per CALL_END_SPACING positions before
them (a reply decoded token by token would otherwise keep a layer's [B, 1, H, dv] sum per token:
1.4 GB for a 4K-token reply of a 3B model); going back there reruns at most twice that many positions.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megadiff.ops import IntegralCarry

CALL_END_SPACING = 64


class KVCache:
    """Up to `max_length` positions (buffers growing as they run) of `batch_size` sequences of `gpt` (TP1/PP1);
    `rewindable`: truncate() may go back to an earlier call's end (the kept ones: see the module), not only
    to the start (DINT only: the other variants go back to any length anyway)."""

    def __init__(self, gpt, batch_size: int, max_length: int, rewindable: bool = False):
        # megatron sizes its rotary table by max_sequence_length (one table, shared by the layers); the buffers
        # need only hold the positions run
        self.context = StaticInferenceContext(batch_size, max_length)
        self.allocated_length = 0
        activations = gpt.embedding.word_embeddings.weight  # keys and values share its dtype and device
        self.core_attentions = [layer.self_attention.core_attention for layer in gpt.decoder.layers]
        for layer in gpt.decoder.layers:
            attention = layer.self_attention
            # megatron would allocate these on torch.cuda.current_device(); here they sit with the model
            self.context.key_value_memory_dict[attention.layer_number] = tuple(
                torch.empty(0, batch_size, attention.num_query_groups_per_partition, width,
                            dtype=activations.dtype, device=activations.device)
                for width in (attention.key_hidden_size, attention.val_hidden_size))
        self.carries = [IntegralCarry() if getattr(core, "integral", False) else None for core in self.core_attentions]
        self.integral = any(carry is not None for carry in self.carries)
        self.rewindable = rewindable
        self.call_ends: dict[int, list] = {}  # length -> the carries' snapshots, when integral and rewindable
        self.call_end_spacing = CALL_END_SPACING

    @property
    def length(self) -> int:
        """Positions cached so far: the next call's first position."""
        return self.context.sequence_len_offset

    @property
    def max_length(self) -> int:
        """The most positions it may hold (its buffers hold allocated_length now)."""
        return self.context.max_sequence_length

    def _make_room(self, length: int) -> None:
        """Buffers of at least `length` positions (within max_length), the cached ones moved into them."""
        if length <= self.allocated_length:
            return
        grown = min(self.max_length, max(length, 2 * self.allocated_length))
        memory = self.context.key_value_memory_dict
        for layer_number, buffers in memory.items():  # one layer at a time: its old buffers go as it moves
            memory[layer_number] = tuple(_longer(buffer, grown, self.length) for buffer in buffers)
        self.allocated_length = grown

    def reset(self) -> None:
        """Forget every position (the buffers are reused)."""
        self.context.reset()
        self.call_ends.clear()
        for carry in self.carries:
            if carry is not None:
                carry.reset()

    def mark(self) -> tuple[int, list]:
        """The cache's state now, for rewind(): a prefix shared by several continuations."""
        return self.length, [None if carry is None else carry.snapshot() for carry in self.carries]

    def rewind(self, mark: tuple[int, list]) -> None:
        """Back to the positions held at mark() (later ones are overwritten by the next call)."""
        self.context.sequence_len_offset, snapshots = mark
        for carry, snapshot in zip(self.carries, snapshots):
            if carry is not None:
                carry.restore(snapshot)
        self.call_ends = {length: snapshots for length, snapshots in self.call_ends.items()
                          if length <= self.length}

    def truncate(self, length: int) -> int:
        """Forget the positions from `length` on (at most the cached ones); returns how many are kept:
        `length`, or with DINT the longest call's end not past it whose running sum is known."""
        if length >= self.length:
            return self.length
        if not self.integral:
            self.context.sequence_len_offset = length
            return length
        kept = max((end for end in self.call_ends if end <= length), default=0)
        if kept == 0:
            self.reset()
        else:
            self.rewind((kept, self.call_ends[kept]))
        return kept

    def forget_call_ends_before(self, length: int) -> None:
        """Drop the running sums kept at call ends before `length`: a sequence that only grows past
        it never goes back there, and each sum is a layer's [B, 1, H, dv] per generated token."""
        self.call_ends = {end: snapshots for end, snapshots in self.call_ends.items() if end >= length}

    @contextmanager
    def extending(self, positions: int):
        """Around a forward pass of the next `positions` positions: attaches the integral carries,
        then counts the positions as cached."""
        if self.length + positions > self.max_length:
            raise ValueError(f"the cache holds {self.max_length} positions: {self.length} cached, {positions} more")
        self._make_room(self.length + positions)
        for core, carry in zip(self.core_attentions, self.carries):
            if carry is not None:
                core.integral_carry = carry
        try:
            yield self.context
        finally:
            for core, carry in zip(self.core_attentions, self.carries):
                if carry is not None:
                    core.integral_carry = None
        self.context.sequence_len_offset += positions
        if self.integral and self.rewindable:
            self.call_ends[self.length] = self.mark()[1]
            self._thin_call_ends()

    def _thin_call_ends(self) -> None:
        """Keep the call ends among the last `call_end_spacing` positions, and the first of each
        `call_end_spacing` positions before them."""
        spacing, spans_seen = self.call_end_spacing, set()
        for end in sorted(self.call_ends):
            if end > self.length - spacing:
                break
            if end // spacing in spans_seen:
                del self.call_ends[end]
            spans_seen.add(end // spacing)


def _longer(buffer: torch.Tensor, length: int, kept: int) -> torch.Tensor:
    """A [length, ...] buffer holding `buffer`'s first `kept` positions."""
    longer = buffer.new_empty(length, *buffer.shape[1:])
    longer[:kept] = buffer[:kept]
    return longer
