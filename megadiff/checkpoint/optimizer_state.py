"""The optimizer's part of a checkpoint, with megatron-core 0.16.1's distributed-optimizer bugs mended.

With the distributed optimizer and torch's AdamW (no Apex/TE fused Adam), 0.16.1:
  a) fails to save its default format ("ShardedTensor.flattened_range is not supported"):
     we use the `fully_reshardable` format, which also reshards across TP/PP/DP;
  b) cannot build a loading state dict for a fresh optimizer (asserts one Adam `step` over an
     empty state), then fails to load (KeyError 'step': it copies every state entry but the
     checkpoint's tensors have no `step`);
  c) after loading, gives all parameters ONE shared `step` tensor, which AdamW increments once
     per parameter: the bias correction is silently wrong and the loss diverges from the
     uninterrupted run two steps after a resume;
  d) cannot checkpoint an optimizer that has not updated yet (an fp16 run's first steps are loss-scaler
     skips; a run preempted while it starts stops after its first step): torch's AdamW creates a
     parameter's state at its first update, and the distributed optimizer's save asserts one `step`
     over the empty state, while the other's saves it empty and then cannot load it (a loading request
     holds every parameter's moments). Before such a save the state is created as AdamW would (zero
     moments, step 0), which leaves the next update as it was; megatron saves no step of 0 (`if step:`),
     so a loaded state without one gets it back;
  e) saves each parameter's state from the wrong place wherever a gradient buffer holds several buckets and one
     ends in padding (the distributed optimizer pads every bucket to a multiple of lcm(DP, 128): a data-parallel
     size such as 3 or 6 with parallel.overlap_grad_reduce's buckets, or the tied embedding's own bucket under
     pipeline parallelism): it gathers the state with the padding between buckets left out, then slices it at
     the parameters' offsets in the padded buffer. The parameters after such a padding were saved shifted into
     their neighbours' values, and a resumed run trained from corrupted weights and moments;
  f) holds the state about twice over on the data-parallel rank 0 that gathers it: it gathers it into one tensor a
     buffer, of which it describes views, and dist_checkpointing's writer clones every host tensor that is a view.
     Rank 0 instead gathers each parameter's state, a window of elements at a time, into a tensor of its own that
     is the one written: its peak is the state plus a window (GATHER_NUMEL), where it was over twice the state.
checkpoint.optimizer_format=parallel saves megatron's `dp_reshardable` format instead: each data-parallel rank writes
its own part of each bucket, padding included (no gather: (e) and (f) do not arise), and reads it back into the same
bucket layout (any data-parallel size). Mends (b)-(d) hold for it as they are, and
  g) its load copies the saved fp32 main weights into the optimizer's outside torch.no_grad: where the model is fp32,
     those are views of the model's parameters, and the load failed ("a view of a leaf Variable that requires grad is
     being used in an in-place operation"). The load runs under no_grad.
A save gathers each tensor/pipeline shard's state on its data-parallel rank 0 alone, over gloo (megatron's
`distrib_optim_fully_reshardable_mem_efficient`): by default every data-parallel rank all-gathers the whole shard's
state (fp32 weights and both moments, 12 bytes a parameter) into host memory though only rank 0's copy is written,
DP times the state on every node (a 13B model at TP 1: 157 GB on each rank). The files written are the same.
A load reads, on each rank, only the parameters of which its optimizer holds a part, into uninitialised buffers
whose untouched pages take no memory: megatron had every rank request every parameter of its shard into zeroed ones,
the whole shard's state written on each rank at every resume. What a rank reads is whole parameters, as before.
Each mend below is local to one optimizer instance and keeps megatron's own code paths.

A checkpoint saved without mend (e) (before it existed) holds such shifted state: `main_params_unlike_weights`
finds it at load, where the saved fp32 main weights, cast to the model's dtype, are not the saved weights.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

DISTRIBUTED_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
SAVE_FORMAT = {**DISTRIBUTED_FORMAT, "distrib_optim_fully_reshardable_mem_efficient": True}
# checkpoint.optimizer_format=parallel: each data-parallel rank writes (and reads) its own part of each bucket
PARALLEL_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed(optimizer) -> list[DistributedOptimizer]:
    return [inner for inner in _inner_optimizers(optimizer) if isinstance(inner, DistributedOptimizer)]


def optimizer_sharded_state(optimizer, model_sharded_state: dict, is_loading: bool,
                            optimizer_format: str = "reshardable") -> dict:
    """The optimizer's part of a save or a loading request, in `optimizer_format` (checkpoint.optimizer_format's
    values): a load's the checkpoint's own (saved_optimizer_format)."""
    if is_loading:
        for inner in _distributed(optimizer):
            if not inner.optimizer.state:  # (b) Adam state must exist before its layout is described
                inner._init_optimizer_states_with_dummy_values()
    else:
        for inner in _with_torch_adam(optimizer):
            _create_state_before_first_update(inner)  # (d)
    if optimizer_format == "parallel":  # no gather, so none of (e) and (f): each rank's own buckets, as they are
        return optimizer.sharded_state_dict(model_sharded_state, is_loading=is_loading, metadata=PARALLEL_FORMAT)
    distributed = _distributed(optimizer)
    for inner in distributed:
        if is_loading:
            inner.get_parameter_state_dp_zero = _load_targets_in_buffer_layout(inner)
            inner.sharded_param_state_fully_reshardable = _requesting_held_parameters(inner)
        else:
            inner.sharded_param_state_fully_reshardable = _gathered_in_saved_tensors(inner)  # (e), (f)
    try:
        metadata = DISTRIBUTED_FORMAT if is_loading else SAVE_FORMAT  # a load reads, whatever the flag, on every rank
        state = optimizer.sharded_state_dict(model_sharded_state, is_loading=is_loading, metadata=metadata)
        return state if is_loading else _without_state_gathered_elsewhere(state, len(_inner_optimizers(optimizer)))
    finally:
        for inner in distributed:  # back to the class's methods
            inner.__dict__.pop("get_parameter_state_dp_zero", None)
            del inner.sharded_param_state_fully_reshardable


def _without_state_gathered_elsewhere(state: dict, inner_count: int) -> dict:
    """`state` less the `param_state` of None that megatron's SAVE_FORMAT leaves on every data-parallel rank but 0
    (which gathers and writes it): a None is a common value, which dist_checkpointing compares with rank 0's (a dict of
    sharded tensors, not common), and every save warned on each of those ranks that its "common state dict differs
    from rank 0 common state dict". Rank 0 writes the common state, which this leaves as it was."""
    for inner_state in [state] if inner_count == 1 else [state[index] for index in range(inner_count)]:
        if "param_state" in inner_state and inner_state["param_state"] is None:
            del inner_state["param_state"]
    return state


STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _load_targets_in_buffer_layout(inner: DistributedOptimizer):
    """What megatron's gather returns for a load (its shape only), laid out as each buffer is (its padding included):
    uninitialised, so that only the pages a load writes take memory. Every element a load uses is read into them:
    the parameters `_requesting_held_parameters` requests, whole."""
    def empty_in_buffer_layout(*args, **kwargs):
        state = {"buckets_coalesced": True}
        for index, (buffer, ranges) in enumerate(zip(inner.buffers, inner.gbuf_ranges, strict=True)):
            state[index] = {dtype: {**{key: torch.empty(buffer.numel, dtype=torch.float32) for key in STATE_KEYS},
                                    "numel_unpadded": buffer.numel_unpadded}
                            for dtype in ranges}
        return state

    return empty_in_buffer_layout


def _requesting_held_parameters(inner: DistributedOptimizer):
    """megatron's loading request, less the parameters of which this rank's optimizer holds nothing (its loading
    skips them), so that each rank reads about its share of the state, not its whole tensor/pipeline shard's.

    Each parameter's main replica (which megatron checks that exactly one rank of each replica set requests) is
    then the data-parallel rank holding its first element, not DP rank 0, which may no longer request it."""
    describe = inner.sharded_param_state_fully_reshardable

    def held_parameters_only(model_sharded_state_dict, is_loading=False, metadata=None):
        request = describe(model_sharded_state_dict, is_loading, metadata)
        held = _held_parameter_ranges(inner)
        return {index: {key: replace(tensor, replica_id=_replica_id(tensor.replica_id, held[index]))
                        for key, tensor in tensors.items()}
                for index, tensors in request.items() if index in held}

    return held_parameters_only


def _held_parameter_ranges(inner: DistributedOptimizer) -> dict:
    """The ranges (megatron's `param_range_map`) of the parameters of which this rank's optimizer holds a part, by
    their index in megatron's order of the fully_reshardable state (each buffer's `param_index_map`)."""
    held = {param: param_range for ranges in inner.gbuf_ranges for bucket_ranges in ranges.values()
            for bucket_range in bucket_ranges for param, param_range in bucket_range["param_map"].items()}
    in_order = (param for buffer in inner.buffers for param in buffer.param_index_map)
    return {index: held[param] for index, param in enumerate(in_order) if param in held}


def _replica_id(model_replica_id: tuple, param_range: dict) -> tuple:
    """The model parameter's replica id (its last entry the data-parallel rank's), the data-parallel part main (0)
    on the rank whose part of the parameter begins it."""
    return (*model_replica_id[:-1], int(param_range["param"].start != 0))


def _gathered_in_saved_tensors(inner: DistributedOptimizer):
    """megatron's description of a save, its tensors ones that hold each parameter's gathered state whole (f), filled
    from a few elements of each data-parallel rank at a time.

    megatron gathered the state into one tensor a buffer (the shard's whole state) and described views of it, which
    dist_checkpointing's writer then cloned (it clones every host tensor that is a view): data-parallel rank 0 held the
    state about twice over. (e) each parameter's state is copied from its own range of its padded bucket."""
    describe = inner.sharded_param_state_fully_reshardable

    def gathered_into_saved_tensors(model_sharded_state_dict, is_loading=False, metadata=None):
        everywhere = not metadata.get("distrib_optim_fully_reshardable_mem_efficient", False)
        receiving = everywhere or inner.data_parallel_group_gloo.rank() == 0
        inner.get_parameter_state_dp_zero = lambda **_: _shapes_in_buffer_layout(inner) if receiving else None
        try:
            described = describe(model_sharded_state_dict, is_loading, metadata)
        finally:
            del inner.get_parameter_state_dp_zero
        gathered = _gathered_by_parameter(inner, everywhere, receiving)
        if described is None:
            return None
        params = _params_in_saved_order(inner)
        return {index: {key: _holding(tensor, gathered[params[index]][key]) for key, tensor in tensors.items()}
                for index, tensors in described.items()}

    return gathered_into_saved_tensors


def _holding(described, data: torch.Tensor):
    """megatron's `described` tensor of the save holding `data`; a factory's (SwiGLU's fc1: halves of its rows) builds
    shards that own their data. Its shards were views of `data`, which the writer clones while `data` stays: the state
    of every fc1 (about 40% of a SwiGLU model's) held twice. A factory is built as the save begins, one at a time,
    each then replaced by its shards, so `data` is freed as they are cloned."""
    if isinstance(described, ShardedTensorFactory):
        return replace(described, data=data, build_fn=_building_owned_shards(described.build_fn))
    return replace(described, data=data)


def _building_owned_shards(build_fn):
    def build_owned_shards(*args):
        return dict_list_map_inplace(_owning_its_data, build_fn(*args))

    return build_owned_shards


def _owning_its_data(shard):
    is_view = shard.data.untyped_storage().nbytes() != shard.data.nbytes  # as dist_checkpointing's writer tells
    return replace(shard, data=shard.data.clone()) if is_view else shard


def _shapes_in_buffer_layout(inner: DistributedOptimizer) -> dict:
    """What megatron's gather returns, on the meta device (no memory): for megatron to describe the state from."""
    return {"buckets_coalesced": True,
            **{index: {dtype: {key: torch.empty(buffer.numel, dtype=torch.float32, device="meta") for key in STATE_KEYS}
                       for dtype in ranges}
               for index, (buffer, ranges) in enumerate(zip(inner.buffers, inner.gbuf_ranges, strict=True))}}


def _gathered_by_parameter(inner: DistributedOptimizer, everywhere: bool, receiving: bool) -> dict:
    """{model parameter: {state key: its fp32 state, whole, in the parameter's shape}} of the tensor/pipeline shard,
    on data-parallel rank 0 (on every rank if `everywhere`); empty on the others, which only send."""
    targets = {param: {key: torch.zeros(param.shape, dtype=torch.float32) for key in STATE_KEYS}
               for param in _params_in_saved_order(inner)} if receiving else {}
    for buffer, ranges in zip(inner.buffers, inner.gbuf_ranges, strict=True):
        (bucket_ranges,) = ranges.values()  # one dtype a buffer, as megatron asserts
        for bucket, bucket_range in zip(buffer.buckets, bucket_ranges, strict=True):
            for key in STATE_KEYS:
                sent = _Pieces((param_range["gbuf_local"].start,
                                inner._get_main_param_and_optimizer_states(param)[key].detach().view(-1))
                               for param, param_range in bucket_range["param_map"].items())
                received = _Pieces((buffer.param_index_map[param][0] - bucket.offset, targets[param][key].view(-1))
                                   for param in bucket.params_list) if receiving else None
                _gather_bucket(inner.data_parallel_group_gloo, bucket.grad_data.numel(), sent, received, everywhere)
    return targets


# fp32 elements of one state tensor that a save gathers at a time, all data-parallel ranks' together: rank 0 holds
# twice this (gloo's receiving buffer and the one it fills) besides the state it writes
GATHER_NUMEL = 1 << 24


def _gather_bucket(group, bucket_numel: int, sent: "_Pieces", received: "_Pieces | None", everywhere: bool) -> None:
    """One bucket's state of one key, each rank's contiguous part (bucket_numel / DP elements, as the distributed
    optimizer splits a bucket) gathered a window at a time, from the ranks' `sent` pieces into `received`'s."""
    ranks = group.size()
    local_numel = bucket_numel // ranks
    window = max(1, GATHER_NUMEL // ranks)
    for start in range(0, local_numel, window):
        send = torch.zeros(min(window, local_numel - start), dtype=torch.float32)  # zeros in the padding
        for window_part, piece in sent.overlapping(start, send.numel()):
            send[window_part].copy_(piece)
        receive = [torch.empty_like(send) for _ in range(ranks)] if received is not None else None
        if everywhere:
            torch.distributed.all_gather(receive, send, group=group)
        else:
            torch.distributed.gather(send, receive, group=group, group_dst=0)
        for rank, part in enumerate(receive or []):
            for window_part, piece in received.overlapping(rank * local_numel + start, part.numel()):
                piece.copy_(part[window_part])


class _Pieces:
    """Flat tensors that hold disjoint ranges of one coordinate (a bucket, or a rank's part of it), each given by
    where it starts there."""

    def __init__(self, pieces):
        self.pieces = sorted(pieces, key=lambda piece: piece[0])
        self.ends = [start + tensor.numel() for start, tensor in self.pieces]

    def overlapping(self, window_start: int, window_numel: int):
        """(slice of the window, view of the piece) for each piece overlapping the window's range: its common part."""
        window_end = window_start + window_numel
        for start, tensor in itertools.islice(self.pieces, bisect.bisect_right(self.ends, window_start), None):
            if start >= window_end:
                return
            low, high = max(start, window_start), min(start + tensor.numel(), window_end)
            yield slice(low - window_start, high - window_start), tensor[low - start:high - start]


def main_params_unlike_weights(optimizer, state: dict, chunks: list) -> list[str]:
    """The parameters of `chunks` (holding the checkpoint's weights) whose fp32 main weights in the loaded distributed
    optimizer `state` are not those weights: every step ends by casting its main weights into the model's, and a
    checkpoint is written from both after it, so they agree exactly wherever the state was saved where it belongs.
    A rank loads the state of the parameters its optimizer holds a part of (`_requesting_held_parameters`): those are
    the ones it compares. The parallel format, never gathered, was never shifted."""
    names = {param: name for chunk in chunks for name, param in chunk.named_parameters()}
    inners = _inner_optimizers(optimizer)
    inner_states = [state] if len(inners) == 1 else [state[index] for index in range(len(inners))]
    return [names[param] for inner, inner_state in zip(inners, inner_states, strict=True)
            if isinstance(inner, DistributedOptimizer)
            and inner_state["param_state_sharding_type"] == DISTRIBUTED_FORMAT["distrib_optim_sharding_type"]
            for index, param in enumerate(_params_in_saved_order(inner))
            if index in inner_state["param_state"]
            and not _is_cast_of(inner_state["param_state"][index]["param"], param)]


def _is_cast_of(main_param: torch.Tensor, param: torch.Tensor) -> bool:
    # megatron loads the state into host memory, whatever device the parameters are on
    return torch.equal(main_param.to(param.device, param.dtype).view_as(param), param.detach())


def _params_in_saved_order(inner: DistributedOptimizer) -> list:
    """The model parameters in the order of the `fully_reshardable` state's entries (megatron's
    `load_parameter_state_from_fully_reshardable` numbers them so)."""
    return [param for buffer in inner.buffers for param in buffer.param_index_map]


def _with_torch_adam(optimizer) -> list:
    """megatron's optimizers around a torch Adam(W) (TransformerEngine's FusedAdam keeps no step per parameter)."""
    return [inner for inner in _inner_optimizers(optimizer) if isinstance(inner.optimizer, torch.optim.Adam)]


def _create_state_before_first_update(inner) -> None:
    """(d) The state torch's Adam(W) creates at its first update, where it has made none yet (after one, every
    parameter has its state and its step: any left out would make the distributed optimizer's steps differ)."""
    adam = inner.optimizer
    if any(adam.state.values()):
        return
    inner.init_state_fn(adam, inner.config)  # megatron's zero moments
    for param_state in adam.state.values():
        param_state["step"] = torch.tensor(0.0)


def _keep_current_step(inner: DistributedOptimizer):
    set_states = inner._set_main_param_and_optimizer_states

    def set_with_step(model_param, tensors):
        group_index, group_order = inner.model_param_group_index_map[model_param]
        main_param = inner.optimizer.param_groups[group_index]["params"][group_order]
        step = inner.optimizer.state[main_param].get("step")
        set_states(model_param, tensors if step is None else {**tensors, "step": step})  # (b)

    return set_with_step


def load_optimizer_state(optimizer, state: dict) -> None:
    """The saved Adam state (moments, steps) into `optimizer`. Its param groups' settings stay this run's: loading
    replaced them with the saved run's max_lr and min_lr (which megatron's scheduler reads before its own), betas
    and eps, so a new phase from another run's checkpoint (the 64K extension) trained at that run's peak lr."""
    configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    _load_adam_state(optimizer, state)
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)


def _load_adam_state(optimizer, state: dict) -> None:
    distributed, adams = _distributed(optimizer), [inner.optimizer for inner in _with_torch_adam(optimizer)]
    for inner in distributed:
        inner._set_main_param_and_optimizer_states = _keep_current_step(inner)
    for adam in adams:
        adam.load_state_dict = _load_with_steps(adam)
    try:
        with torch.no_grad():  # (g) the parallel format's load copies into fp32 main weights, views of the model's
            optimizer.load_state_dict(state)
    finally:
        for inner in distributed:
            del inner._set_main_param_and_optimizer_states  # back to the class's method
        for adam in adams:
            del adam.load_state_dict
    for inner in distributed:
        for param_state in inner.optimizer.state.values():  # (c) one step counter per parameter
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()


def _load_with_steps(adam: torch.optim.Adam):
    """(d) A state saved before the first update has no step (megatron drops one of 0), which torch requires."""
    load = adam.load_state_dict

    def load_with_steps(state_dict: dict) -> None:
        for param_state in state_dict["state"].values():
            param_state.setdefault("step", torch.tensor(0.0))
        load(state_dict)

    return load_with_steps
