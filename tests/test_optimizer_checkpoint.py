"""Each mend of megatron-core 0.16.1's distributed-optimizer checkpointing is needed, and enough.

Negative controls: megatron's own calls fail (or silently share one Adam step counter) where
megadiff.checkpoint.optimizer_state succeeds; loading keeps the loading run's param-group settings.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.parity_worker import MODEL, global_micro_batches

STEPS = 2


def _train(engine, cfg) -> None:
    from megadiff.training.step import train_step

    for _ in range(STEPS):
        batches = global_micro_batches(cfg, 0)
        train_step(engine, iter(batches), len(batches))


def _trained_diff(world_size: int):
    """(config, engine) of a DIFF model with the distributed optimizer, trained a few steps on this rank."""
    from megadiff.config import build_config
    from megadiff.parallel import initialize
    from megadiff.training.engine import build_engine

    cfg = build_config({}, MODEL + ["model.variant=diff", "parallel.distributed_optimizer=true"], world_size)
    initialize(cfg.parallel, seed=0)
    engine = build_engine(cfg)
    _train(engine, cfg)
    return cfg, engine


def _settings(optimizer) -> list[dict]:
    """What of each param group a run configures (loading also adds megatron's bookkeeping, e.g. a `step`)."""
    keys = ("max_lr", "min_lr", "lr", "betas", "eps", "weight_decay")
    return [{key: group[key] for key in keys} for group in optimizer.param_groups]


def _worker(rank: int, world_size: int, checkpoint: str, out: str) -> None:
    from megatron.core import dist_checkpointing

    from megadiff.checkpoint.format import model_sharded_state
    from megadiff.checkpoint.optimizer_state import (
        DISTRIBUTED_FORMAT, load_optimizer_state, optimizer_sharded_state,
    )
    from megadiff.parallel import shutdown
    from megadiff.training.engine import build_engine

    cfg, trained = _trained_diff(world_size)
    for group in trained.optimizer.param_groups:  # a checkpoint of another run's settings (its peak lr)
        group["max_lr"] *= 10
    state = model_sharded_state(trained.unwrapped())
    state["optimizer"] = optimizer_sharded_state(trained.optimizer, state, is_loading=False)
    dist_checkpointing.save(state, checkpoint)

    def fresh_request(engine, mended: bool):
        request = model_sharded_state(engine.unwrapped())
        if mended:
            request["optimizer"] = optimizer_sharded_state(engine.optimizer, request, is_loading=True)
        else:
            request["optimizer"] = engine.optimizer.sharded_state_dict(request, is_loading=True,
                                                                       metadata=DISTRIBUTED_FORMAT)
        return dist_checkpointing.load(request, checkpoint)["optimizer"]

    report = {}
    try:
        fresh_request(build_engine(cfg), mended=False)
    except AssertionError:
        report["megatron_describe_fresh"] = "AssertionError"
    engine = build_engine(cfg)
    try:
        engine.optimizer.load_state_dict(fresh_request(engine, mended=True))
    except KeyError as err:
        report["megatron_load"] = f"KeyError {err}"
    engine = build_engine(cfg)
    configured = _settings(engine.optimizer)
    load_optimizer_state(engine.optimizer, fresh_request(engine, mended=True))
    report["settings_kept"] = _settings(engine.optimizer) == configured != _settings(trained.optimizer)
    steps = [s["step"] for inner in engine.optimizer.chained_optimizers for s in inner.optimizer.state.values()]
    report["steps"] = [float(s) for s in steps]
    report["distinct_step_tensors"] = len({id(s) for s in steps}) == len(steps)
    expected = [s for inner in trained.optimizer.chained_optimizers for s in inner.optimizer.state.values()]
    report["moments_equal"] = all(all(torch.equal(a[key], b[key]) for key in ("exp_avg", "exp_avg_sq"))
                                  for a, b in zip(expected, (s for inner in engine.optimizer.chained_optimizers
                                                             for s in inner.optimizer.state.values())))
    shutdown()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)


def test_distributed_optimizer_round_trip_needs_each_mend(tmp_path):
    out = tmp_path / "report.json"
    (tmp_path / "ckpt").mkdir()
    run_ranks(2, _worker, str(tmp_path / "ckpt"), str(out))
    report = json.loads(out.read_text())
    assert report["megatron_describe_fresh"] == "AssertionError"       # mend (b), first half
    assert report["megatron_load"].startswith("KeyError")               # mend (b), second half
    assert report["distinct_step_tensors"]                              # mend (c)
    assert report["steps"] and set(report["steps"]) == {STEPS}
    assert report["moments_equal"]
    assert report["settings_kept"]  # this run's lr, betas and eps, not the saved run's


def _weights_only_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import CheckpointWriter, load_training_checkpoint
    from megadiff.config import build_config
    from megadiff.parallel import initialize, set_seed, shutdown
    from megadiff.training.engine import build_engine

    cfg = build_config({}, MODEL + ["model.variant=diff", "train.precision=bf16"], world_size)
    initialize(cfg.parallel, seed=0)
    saved = build_engine(cfg)
    writer = CheckpointWriter(checkpoints, cfg)
    writer.save(1, saved.unwrapped(), saved.optimizer, {"iteration": 1})
    writer.close()
    set_seed(1)  # other initial weights, which the optimizer's fp32 copies start from
    engine = build_engine(cfg)
    expected = dict(saved.unwrapped()[0].named_parameters())

    def mismatched() -> list[str]:
        return [name for name, param in engine.unwrapped()[0].named_parameters()
                if not torch.equal(param, expected[name])]

    report = {"initially_mismatched": len(mismatched())}
    load_training_checkpoint(iteration_dir(checkpoints, 1), engine.unwrapped(), engine.optimizer,
                             load_optimizer=False, restore_rng=False)
    report["loaded_mismatched"] = mismatched()
    for inner in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner._copy_main_params_to_model_params()  # what every step ends with
    report["stepped_from_mismatched"] = mismatched()
    shutdown()
    with open(out, "w") as handle:
        json.dump(report, handle)


def test_weights_loaded_without_the_optimizer_state_are_what_the_optimizer_steps_from(tmp_path):
    """checkpoint.load_optimizer=false (a new phase from another run's weights): with bf16 weights the optimizer
    steps fp32 copies of them and writes those back; copies left at the initial weights would undo the load at
    the first step."""
    out = tmp_path / "report.json"
    run_ranks(1, _weights_only_worker, str(tmp_path / "checkpoints"), str(out))
    report = json.loads(out.read_text())
    assert report["initially_mismatched"] > 0  # a real negative: the fresh model's weights are others
    assert report["loaded_mismatched"] == [] and report["stepped_from_mismatched"] == []


# the tied embedding in a bucket of its own (pipeline parallelism with the distributed optimizer), after a bucket
# of this tiny model's chunk whose size is no multiple of 128: megatron pads it, as it pads the buckets of a large
# model under parallel.overlap_grad_reduce when lcm(DP, 128) > 128
PADDED_BETWEEN_BUCKETS = ["model.variant=diff", "model.tie_embeddings=true", "parallel.distributed_optimizer=true",
                          "parallel.pipeline=2", "parallel.virtual_pipeline=2"]


def _padding_between_buckets(engine) -> int:
    return sum(end - start - bucket.numel_unpadded for chunk in engine.model for buffer in chunk.buffers
               for bucket, (start, end) in zip(buffer.buckets[:-1], buffer.bucket_indices[:-1]))


def _step_all_chunks(engine, cfg) -> float:
    from megadiff.training.step import train_step

    batches = global_micro_batches(cfg, 0)
    return train_step(engine, [iter(batches) for _ in engine.model], len(batches)).loss


def _adam_states(engine) -> list[torch.Tensor]:
    return [tensor for inner in engine.optimizer.chained_optimizers for state in inner.optimizer.state.values()
            for key, tensor in sorted(state.items()) if key != "step"]


def _trained_and_saved(world_size: int, checkpoints: str, save_state=None):
    """(config, engine) of the padded-buckets layout trained STEPS steps and saved to `checkpoints`; `save_state`
    replaces optimizer_state's (e) mend during the save."""
    from megadiff.checkpoint import optimizer_state
    from megadiff.checkpoint.training_checkpoint import CheckpointWriter
    from megadiff.config import build_config
    from megadiff.parallel import initialize
    from megadiff.training.engine import build_engine

    cfg = build_config({}, MODEL + PADDED_BETWEEN_BUCKETS, world_size)
    initialize(cfg.parallel, seed=0)
    engine = build_engine(cfg)
    for _ in range(STEPS):
        _step_all_chunks(engine, cfg)
    mend = optimizer_state._gathered_in_saved_tensors
    optimizer_state._gathered_in_saved_tensors = save_state or mend
    try:
        writer = CheckpointWriter(checkpoints, cfg)
        writer.save(STEPS, engine.unwrapped(), engine.optimizer, {"iteration": STEPS})
        writer.close()
    finally:
        optimizer_state._gathered_in_saved_tensors = mend
    return cfg, engine


def _padded_buckets_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint import optimizer_state
    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import load_training_checkpoint
    from megadiff.parallel import shutdown
    from megadiff.training.engine import build_engine

    optimizer_state.GATHER_NUMEL = 1000  # windows of the gather that begin and end inside parameters
    cfg, uninterrupted = _trained_and_saved(world_size, checkpoints)
    resumed = build_engine(cfg)
    with _model_entries_loaded_as_copies(resumed) as copied:
        load_training_checkpoint(iteration_dir(checkpoints, STEPS), resumed.unwrapped(), resumed.optimizer,
                                 restore_rng=False)
    report = {"padding": _padding_between_buckets(resumed), "copied": copied,
              "weights_differ": [name for chunks in zip(uninterrupted.unwrapped(), resumed.unwrapped(), strict=True)
                                 for (name, expected), (_, loaded) in zip(*(c.named_parameters() for c in chunks))
                                 if not torch.equal(loaded, expected)],
              "adam_states_equal": all(torch.equal(a, b) for a, b in zip(_adam_states(uninterrupted),
                                                                          _adam_states(resumed), strict=True)),
              "next_losses": [_step_all_chunks(engine, cfg) for engine in (uninterrupted, resumed)]}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


@contextlib.contextmanager
def _model_entries_loaded_as_copies(engine):
    """The model entries of a training load that come back as tensors of their own, not read into the parameters:
    megatron merged SwiGLU's fc1 halves with torch.cat, a copy of every fc1 (40% of a large model) on the GPU."""
    from megadiff.checkpoint import training_checkpoint
    from megadiff.checkpoint.format import model_keys

    storages = {param.untyped_storage().data_ptr() for chunk in engine.unwrapped() for param in chunk.parameters()}
    load, copied = training_checkpoint.load_sharded, []

    def recording(request, checkpoint_dir):
        loaded = load(request, checkpoint_dir)
        entries = [entry for key in model_keys(len(engine.unwrapped())) for entry in loaded[key].items()]
        copied.extend(name for name, value in entries
                      if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in storages)
        return loaded

    training_checkpoint.load_sharded = recording
    try:
        yield copied
    finally:
        training_checkpoint.load_sharded = load


@pytest.mark.parametrize("world_size", [2, 4])  # data-parallel size 1 and 2
def test_a_checkpoint_of_buckets_padded_between_resumes_the_uninterrupted_run(tmp_path, world_size):
    """(e) megatron slices the gathered state at the parameters' offsets in the padded buffer: the parameters after
    a padding were saved shifted (here the tied embedding, on the first stage and the last)."""
    out = tmp_path / "report.json"
    run_ranks(world_size, _padded_buckets_worker, str(tmp_path / "checkpoints"), str(out))
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]
    assert any(report["padding"] for report in reports), "no padding between buckets: the mend goes unexercised"
    for rank, report in enumerate(reports):
        assert report["weights_differ"] == [] and report["adam_states_equal"], rank
        assert report["copied"] == [], rank  # every model entry read into its parameter, SwiGLU's fc1 too
        uninterrupted, resumed = report["next_losses"]
        assert resumed == uninterrupted


def _after_padding(engine) -> list[str]:
    """The parameters whose checkpoint state megatron's unmended save shifts: those after a bucket's padding in their
    buffer, and their tied copies on other ranks (the checkpoint holds one copy of a key: its main replica's)."""
    import torch.distributed as dist

    from megadiff.checkpoint.gather import model_sharded_tensors

    keys = {id(shard.data): shard.key for shard in model_sharded_tensors(engine.unwrapped())}
    named = [(name, param) for chunk in engine.unwrapped() for name, param in chunk.named_parameters()]
    shifted = set()
    for chunk in engine.model:
        for buffer in chunk.buffers:
            padding_ends = [end for bucket, (start, end) in zip(buffer.buckets, buffer.bucket_indices)
                            if end - start > bucket.numel_unpadded]
            shifted |= {keys[id(param)] for param, (start, _, _) in buffer.param_index_map.items()
                        if padding_ends and start >= min(padding_ends)}
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, shifted)
    return sorted(name for name, param in named if keys.get(id(param)) in set().union(*everywhere))


def _unmended_save_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint import optimizer_state
    from megadiff.checkpoint.format import CheckpointError, iteration_dir, model_sharded_state
    from megadiff.checkpoint.training_checkpoint import load_training_checkpoint
    from megadiff.checkpoint.weights import load_into_chunks, load_sharded
    from megadiff.parallel import shutdown
    from megadiff.training.engine import build_engine

    # saved as megadiff saved before (e): by megatron's own description and gather
    cfg, _ = _trained_and_saved(world_size, checkpoints,
                                save_state=lambda inner: inner.sharded_param_state_fully_reshardable)
    checkpoint = iteration_dir(checkpoints, STEPS)
    resumed = build_engine(cfg)
    request = model_sharded_state(resumed.unwrapped())
    request["optimizer"] = optimizer_state.optimizer_sharded_state(resumed.optimizer, request, is_loading=True)
    loaded = load_sharded(request, checkpoint)
    load_into_chunks(resumed.unwrapped(), loaded)
    report = {"expected": _after_padding(resumed),
              "unlike": sorted(optimizer_state.main_params_unlike_weights(resumed.optimizer, loaded["optimizer"],
                                                                          resumed.unwrapped()))}
    fresh = build_engine(cfg)
    try:
        load_training_checkpoint(checkpoint, fresh.unwrapped(), fresh.optimizer, restore_rng=False)
    except CheckpointError as error:
        report["refusal"] = str(error)
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def _gathered_bytes_recorded(sizes: list) -> None:
    """Each save's description of the optimizer state appends here the bytes of the tensors it holds on this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    from megadiff.checkpoint import training_checkpoint

    describe = training_checkpoint.optimizer_sharded_state

    def recorded(*args, **kwargs):
        state = describe(*args, **kwargs)
        sizes.append(sum(tensor.data.untyped_storage().nbytes() for tensor in nested_values(state)
                         if isinstance(tensor, ShardedBase) and torch.is_tensor(tensor.data)))
        return state

    training_checkpoint.optimizer_sharded_state = recorded


def _save(engine, cfg, checkpoints: str) -> None:
    from megadiff.checkpoint.training_checkpoint import CheckpointWriter

    writer = CheckpointWriter(checkpoints, cfg)
    writer.save(STEPS, engine.unwrapped(), engine.optimizer, {"iteration": STEPS})
    writer.close()


def _loaded_adam_states(cfg, checkpoints: str) -> list[torch.Tensor]:
    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import load_training_checkpoint
    from megadiff.training.engine import build_engine

    engine = build_engine(cfg)
    load_training_checkpoint(iteration_dir(checkpoints, STEPS), engine.unwrapped(), engine.optimizer,
                             restore_rng=False)
    return _adam_states(engine)


def _resumes_its_adam_state(engine, cfg, checkpoints: str) -> bool:
    """Whether a fresh engine loading `checkpoints` holds `engine`'s Adam state exactly."""
    return all(torch.equal(saved, loaded) for saved, loaded in zip(
        _adam_states(engine), _loaded_adam_states(cfg, checkpoints), strict=True))


def _gathered_on_save_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint import optimizer_state
    from megadiff.parallel import shutdown

    cfg, trained = _trained_diff(world_size)
    gathered: list[int] = []
    _gathered_bytes_recorded(gathered)
    _save(trained, cfg, f"{checkpoints}/now")
    optimizer_state.SAVE_FORMAT = optimizer_state.DISTRIBUTED_FORMAT  # as saved before: all-gathered on every rank
    _save(trained, cfg, f"{checkpoints}/before")
    report = {"gathered_on_save": gathered[0],
              "shard_state": sum(12 * param.numel() for chunk in trained.model for buffer in chunk.buffers
                                 for param in buffer.params),
              "loads_equal": [all(torch.equal(a, b) for a, b in zip(_adam_states(trained),
                                                                    _loaded_adam_states(cfg, f"{checkpoints}/{name}"),
                                                                    strict=True))
                              for name in ("now", "before")]}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def test_a_checkpoint_saved_with_shifted_optimizer_state_is_refused_naming_the_parameters(tmp_path):
    """A checkpoint written before mend (e) holds the state of the parameters after a bucket's padding shifted into
    their neighbours': loading it refuses (every rank), naming them, where it trained silently from corrupt weights."""
    out = tmp_path / "report.json"
    run_ranks(2, _unmended_save_worker, str(tmp_path / "checkpoints"), str(out))
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    expected = sorted({name for report in reports for name in report["expected"]})
    assert expected, "no padding between buckets: nothing was shifted"
    # each rank compares the parameters its optimizer holds a part of (the ones it loads the state of)
    assert sorted({name for report in reports for name in report["unlike"]}) == expected
    for rank, report in enumerate(reports):
        assert set(report["unlike"]) <= set(report["expected"]), rank
        assert "load_optimizer=false" in report["refusal"], rank
    assert any(expected[0] in report["refusal"] for report in reports)


def test_a_save_gathers_the_optimizer_state_on_one_data_parallel_rank_only(tmp_path):
    """Every data-parallel rank all-gathered its tensor/pipeline shard's whole optimizer state (12 bytes a
    parameter) into host memory on each save, though one rank writes it: DP times the state on every node, 157 GB
    on each rank of a 13B model at TP 1. Checkpoints saved so, and now, load alike."""
    out = tmp_path / "report.json"
    run_ranks(2, _gathered_on_save_worker, str(tmp_path / "checkpoints"), str(out))
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert reports[0]["gathered_on_save"] == reports[0]["shard_state"] > 0
    assert reports[1]["gathered_on_save"] == 0
    for report in reports:
        assert report["loads_equal"] == [True, True]


def _requested_bytes(request: dict) -> int:
    from megatron.core.dist_checkpointing.mapping import ShardedBase
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return sum(tensor.data.nbytes for tensor in nested_values(request["optimizer"]) if isinstance(tensor, ShardedBase)
               and torch.is_tensor(tensor.data))


def _requested_on_load_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint.format import model_sharded_state
    from megadiff.checkpoint.optimizer_state import optimizer_sharded_state
    from megadiff.parallel import shutdown
    from megadiff.training.engine import build_engine

    cfg, trained = _trained_diff(world_size)
    _save(trained, cfg, checkpoints)
    resumed = build_engine(cfg)
    request = model_sharded_state(resumed.unwrapped())
    request["optimizer"] = optimizer_sharded_state(resumed.optimizer, request, is_loading=True)
    held = {param for inner in resumed.optimizer.chained_optimizers for param in inner.model_param_group_index_map}
    report = {"requested": _requested_bytes(request),
              "held_parameters": sum(12 * param.numel() for param in held),
              "shard_state": sum(12 * buffer.numel_unpadded for chunk in resumed.model for buffer in chunk.buffers),
              "adam_states_equal": _resumes_its_adam_state(trained, cfg, checkpoints)}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def test_a_load_reads_on_each_rank_only_the_parameters_its_optimizer_holds(tmp_path):
    """Every rank requested (into zeroed buffers: written, so resident) its tensor/pipeline shard's whole optimizer
    state at each resume, DP times what the data-parallel ranks hold. Each rank reads the parameters of which its
    optimizer holds a part, whole, and resumes the same state."""
    out = tmp_path / "report.json"
    run_ranks(4, _requested_on_load_worker, str(tmp_path / "checkpoints"), str(out))
    for rank in range(4):
        report = json.loads(Path(f"{out}.{rank}").read_text())
        assert report["requested"] == report["held_parameters"] < report["shard_state"], rank
        assert report["adam_states_equal"], rank


def _common_state_warnings_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    import logging

    from megadiff.parallel import shutdown

    cfg, engine = _trained_diff(world_size)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(handler)
    _save(engine, cfg, checkpoints)
    report = {"warned": [message for message in warned if "common state dict differs" in message],
              "resumed": _resumes_its_adam_state(engine, cfg, checkpoints)}
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


def test_a_save_gathered_on_data_parallel_rank_0_keeps_the_common_state_alike_on_every_rank(tmp_path):
    """The ranks that gather nothing held a `param_state` of None, a common value rank 0 has not: every save warned
    on each of them that its common state dict differs from rank 0's. The checkpoint still resumes exactly."""
    out = tmp_path / "report.json"
    run_ranks(2, _common_state_warnings_worker, str(tmp_path / "checkpoints"), str(out))
    for rank in range(2):
        report = json.loads(Path(f"{out}.{rank}").read_text())
        assert report == {"warned": [], "resumed": True}, rank


# a model whose optimizer state (S = 12 bytes a parameter, ~140 MB) outweighs a process's noise in host memory
SAVED_MODEL = MODEL + ["model.variant=diff", "parallel.distributed_optimizer=true", "model.hidden_size=384",
                       "model.ffn_hidden_size=768", "model.vocab_size=8000"]
WINDOW_NUMEL = 1 << 18  # the elements a save gathers at a time (optimizer_state.GATHER_NUMEL), this model's size


def _resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _peak_host_memory_of(action) -> int:
    """The bytes by which this process's resident memory rose at most above its level before `action` ran."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's high-water mark back to the current size
    before = _resident_bytes("VmRSS")
    action()
    return _resident_bytes("VmHWM") - before


def _tensor_bytes_held_as_the_writer_starts(action) -> int:
    """The bytes of the tensors live once dist_checkpointing's writer has taken what it writes (its copies made),
    above those live before `action`: exact, where the resident high-water mark also counts the allocator's slack."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from tests.memory_worker import live_tensor_bytes

    prepare = FileSystemWriterAsync.prepare_write_data
    held = []

    def prepared(writer, *args):
        prepare(writer, *args)
        held.append(live_tensor_bytes())

    before = live_tensor_bytes()
    FileSystemWriterAsync.prepare_write_data = prepared
    try:
        action()
    finally:
        FileSystemWriterAsync.prepare_write_data = prepare
    return max(held) - before


def _losses(engine, cfg, steps: range) -> list[float]:
    from megadiff.training.step import train_step

    losses = []
    for step in steps:
        batches = global_micro_batches(cfg, step)
        losses.append(train_step(engine, iter(batches), len(batches)).loss)
    return losses


def _save_memory_worker(rank: int, world_size: int, checkpoints: str, out: str) -> None:
    from megadiff.checkpoint import optimizer_state
    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import load_training_checkpoint
    from megadiff.config import build_config
    from megadiff.parallel import initialize, shutdown
    from megadiff.training.engine import build_engine

    optimizer_state.GATHER_NUMEL = WINDOW_NUMEL
    cfg = build_config({}, SAVED_MODEL, world_size)
    initialize(cfg.parallel, seed=0)
    uninterrupted = build_engine(cfg)
    _losses(uninterrupted, cfg, range(STEPS))
    params = [param for chunk in uninterrupted.unwrapped() for param in chunk.parameters()]
    report = {"peak": _peak_host_memory_of(lambda: _save(uninterrupted, cfg, checkpoints)),
              "held": _tensor_bytes_held_as_the_writer_starts(lambda: _save(uninterrupted, cfg, f"{checkpoints}.2")),
              "state": 12 * sum(param.numel() for param in params),
              # the model's weights, which a save copies to host memory too (the writer clones views of a buffer)
              "weights": sum(param.numel() * param.element_size() for param in params)}
    resumed = build_engine(cfg)
    load_training_checkpoint(iteration_dir(checkpoints, STEPS), resumed.unwrapped(), resumed.optimizer,
                             restore_rng=False)
    report["losses"] = [_losses(engine, cfg, range(STEPS, 2 * STEPS)) for engine in (uninterrupted, resumed)]
    shutdown()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(report, handle)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_save_holds_the_optimizer_state_once_on_the_rank_that_gathers_it(tmp_path, world_size):
    """Data-parallel rank 0 gathered its shard's optimizer state S into one tensor a buffer and megatron described
    views of it, which dist_checkpointing's writer cloned: it peaked over 2 x S (157 GB for 13B at TP 1, twice over).
    It holds S once (in the tensors written) besides the weights the writer copies and a window of the gather, and the
    checkpoint resumes the uninterrupted run. SwiGLU's fc1 state, split in halves by megatron's factory, was held
    twice."""
    out = tmp_path / "report.json"
    run_ranks(world_size, _save_memory_worker, str(tmp_path / "checkpoints"), str(out))
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]
    gathering, *sending = reports
    window_bytes = 4 * WINDOW_NUMEL
    # 0.1 x S: what else a process allocates meanwhile (megatron's own gather: over 2 x S, and S / DP on the others)
    assert gathering["peak"] < gathering["state"] + gathering["weights"] + 0.1 * gathering["state"] + 4 * window_bytes
    # as the files are written: the state and the weights' copies, once (SwiGLU's fc1 state was held twice)
    assert gathering["held"] < gathering["state"] + gathering["weights"] + 0.001 * gathering["state"]
    for rank, report in enumerate(sending, start=1):  # none of the state; the weights they write (fully_parallel_save)
        assert report["peak"] < report["weights"] + 0.1 * report["state"] + 4 * window_bytes, rank
        assert report["held"] < report["weights"] + 0.001 * report["state"], rank
    for rank, report in enumerate(reports):
        uninterrupted, resumed = report["losses"]
        assert resumed == uninterrupted, rank


def _megatron_and_own_saves_worker(rank: int, world_size: int, checkpoints: str) -> None:
    from megadiff.checkpoint import optimizer_state
    from megadiff.parallel import shutdown

    cfg, trained = _trained_diff(world_size)
    _save(trained, cfg, f"{checkpoints}/own")
    mend = optimizer_state._gathered_in_saved_tensors
    optimizer_state._gathered_in_saved_tensors = lambda inner: inner.sharded_param_state_fully_reshardable
    try:
        _save(trained, cfg, f"{checkpoints}/megatron")
    finally:
        optimizer_state._gathered_in_saved_tensors = mend
    shutdown()


def _contents(path: Path):
    """A checkpoint file's bytes; torch's `.metadata`, less what names this save (its directory, a uuid)."""
    if path.name != ".metadata":
        return path.read_bytes()
    import dataclasses
    import pickle

    return dataclasses.replace(pickle.loads(path.read_bytes()), storage_meta=None)


def test_a_save_writes_the_files_megatron_writes_where_its_buckets_are_unpadded(tmp_path):
    """The state gathered by parameter is written as megatron's own save writes it where that is right (no padding
    between buckets): the same files, byte for byte, so checkpoints saved before and after load alike."""
    run_ranks(2, _megatron_and_own_saves_worker, str(tmp_path))
    own, megatron = (sorted(path.relative_to(tmp_path / name) for path in (tmp_path / name).rglob("*")
                            if path.is_file()) for name in ("own", "megatron"))
    assert own == megatron and any(path.suffix == ".distcp" for path in own)
    assert [path for path in own if _contents(tmp_path / "own" / path) != _contents(tmp_path / "megatron" / path)] == []
