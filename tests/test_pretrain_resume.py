"""Exact resume: a run stopped and rerun reproduces the uninterrupted run's whole loss curve.

`megadiff pretrain` in real gloo ranks (run_pretrain_in_ranks) on the bundled KJV corpus; test_launch.py and
test_slurm.py resume runs started as users start them.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megadiff.checkpoint.format import CHECKPOINTS_DIR, checkpoint_config, latest_checkpoint, read_latest_iteration
from megadiff.checkpoint.training_checkpoint import read_train_state
from megadiff.data.manifest import tokenizer_identity
from megadiff.observability.metrics import read_metrics
from megadiff.observability.wandb_sink import RUN_ID_FILE
from tests.pretrain_runs import (
    DEMO_CONFIG, environment, losses, pretrain_command, run_pretrain_in_ranks, tiny_overrides,
)
from tests.wandb_log import logged_history_and_config

ITERS = 6
STOP = 3


@pytest.fixture(scope="module")
def base(small_tokenizer_dir, tmp_path_factory) -> list[str]:
    return tiny_overrides(small_tokenizer_dir, tmp_path_factory.mktemp("data-cache")) + [f"train.iters={ITERS}"]


def _grad_norms(output_dir):
    return [record["grad_norm"] for record in read_metrics(output_dir)]


LAYOUT = ["parallel.tensor=2", "parallel.distributed_optimizer=true"]  # x DP=2 on 4 ranks
WANDB = ["logging.wandb_project=megadiff-tests"]  # the stopped run and its rerun also log to W&B (offline)


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict:
    """An uninterrupted TP=2 x DP=2 run with the distributed optimizer, and the same run stopped at
    iteration STOP (then resumed by the tests): the layout most exposed to megatron 0.16.1's
    distributed-optimizer checkpoint bugs."""
    root = tmp_path_factory.mktemp("resume")
    full, part = root / "uninterrupted", root / "interrupted"
    run_pretrain_in_ranks(4, base + LAYOUT + [f"output_dir={full}"])
    run_pretrain_in_ranks(4, base + LAYOUT + WANDB + [f"output_dir={part}", f"train.exit_interval={STOP}"])
    assert read_latest_iteration(part / CHECKPOINTS_DIR) == STOP
    assert len(losses(part)) == STOP
    return {"full": full, "part": part}


@pytest.mark.slow
def test_rerun_continues_bit_for_bit(base, runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs["part"], resumed)
    rerun = run_pretrain_in_ranks(4, base + LAYOUT + WANDB + [f"output_dir={resumed}"])
    assert f"resumed from {resumed / CHECKPOINTS_DIR}" in rerun.stdout
    assert losses(resumed) == losses(runs["full"])  # every iteration, bit for bit
    assert _grad_norms(resumed) == _grad_norms(runs["full"])
    assert read_latest_iteration(resumed / CHECKPOINTS_DIR) == ITERS

    # one W&B run across the stop (its id kept in the output_dir), logged by rank 0 only,
    # holding exactly metrics.jsonl's losses and the resolved config
    run_id = (resumed / RUN_ID_FILE).read_text().strip()
    wandb_runs = sorted((resumed / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in wandb_runs)
    history, config = logged_history_and_config(wandb_runs)
    assert {r["iteration"]: r["lm_loss"] for r in history if "lm_loss" in r} == pytest.approx(
        {r["iteration"]: r["lm_loss"] for r in read_metrics(resumed) if "lm_loss" in r})
    assert len([r for r in history if "lm_loss" in r]) == ITERS
    assert any("lambda/layer_1" in r for r in history)  # nested metrics keep TensorBoard's names
    assert config["parallel"]["tensor"] == 2 and config["train"]["iters"] == ITERS


@pytest.mark.slow
def test_a_rerun_switching_the_optimizer_format_reads_each_checkpoint_in_its_own(base, runs, tmp_path):
    """The stopped run's reshardable checkpoint resumed by a run saving checkpoint.optimizer_format=parallel, whose
    checkpoint at iteration 5 a last rerun resumes: the uninterrupted curve throughout."""
    switched = tmp_path / "switched"
    shutil.copytree(runs["part"], switched)
    parallel = base + LAYOUT + ["checkpoint.optimizer_format=parallel", f"output_dir={switched}"]
    run_pretrain_in_ranks(4, parallel + ["train.exit_interval=5"])
    assert read_train_state(latest_checkpoint(switched / CHECKPOINTS_DIR))["iteration"] == 5
    run_pretrain_in_ranks(4, parallel)
    assert losses(switched) == losses(runs["full"])
    assert _grad_norms(switched) == _grad_norms(runs["full"])


@pytest.mark.slow
def test_a_rerun_without_the_spike_guard_keeps_no_window_for_a_later_one(base, tmp_path):
    """The spike guard's window is of the steps just before a checkpoint. A run that turns it off (after a part
    with it) saves none, as a run that never had it: a later rerun turning it on again starts from an empty
    window, not the one saved iterations before, against which its first steps would be judged."""
    guard = ["train.skip_spike_sigma=6", "train.spike_window=2"]
    switched, never = tmp_path / "switched", tmp_path / "never"
    run_pretrain_in_ranks(1, base + guard + [f"output_dir={switched}", f"train.exit_interval={STOP}"])
    assert read_train_state(latest_checkpoint(switched / CHECKPOINTS_DIR))["spike_history"]["losses"]
    run_pretrain_in_ranks(1, base + [f"output_dir={switched}"])
    run_pretrain_in_ranks(1, base + [f"output_dir={never}"])
    histories = [read_train_state(latest_checkpoint(run / CHECKPOINTS_DIR))["spike_history"]
                 for run in (switched, never)]
    assert histories[0] == histories[1]


@pytest.mark.slow
def test_resume_into_another_layout_continues_the_curve(base, runs, tmp_path):
    """The TP=2 x DP=2 checkpoint resumed by one process: resharded model and optimizer state."""
    resumed = tmp_path / "resharded"
    shutil.copytree(runs["part"], resumed)
    rerun = run_pretrain_in_ranks(1, base + ["parallel.distributed_optimizer=true", f"output_dir={resumed}"])
    assert "resharded from" in rerun.stdout
    assert losses(resumed) == pytest.approx(losses(runs["full"]), abs=1e-5)
    assert len(losses(resumed)) == ITERS


FP16_ITERS = 16  # fp16's loss scaler skips the first 13 steps (from 2^32), then the optimizer updates


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [["parallel.distributed_optimizer=false"],
                                       ["parallel.distributed_optimizer=true"],
                                       ["parallel.distributed_optimizer=true", "checkpoint.optimizer_format=parallel"]],
                         ids=["optimizer", "distributed", "distributed-parallel-format"])
def test_an_fp16_run_stopped_before_its_first_update_resumes_as_the_uninterrupted_one(base, tmp_path, optimizer):
    """A run preempted as it starts stops after its first step, which fp16's scaler skips: its optimizer had
    no state. The distributed optimizer's save failed (an AssertionError in place of exit code 75), the
    other's checkpoint could not be loaded (dist_checkpointing's "Different dict keys")."""
    run = base + ["train.precision=fp16", f"train.iters={FP16_ITERS}", *optimizer]
    full, stopped = tmp_path / "uninterrupted", tmp_path / "stopped"
    run_pretrain_in_ranks(1, run + [f"output_dir={full}"])
    run_pretrain_in_ranks(1, run + [f"output_dir={stopped}", "train.exit_interval=1"])
    assert [r["loss_scale_overflows"] for r in read_metrics(stopped)] == [1]  # stopped before any update
    run_pretrain_in_ranks(1, run + [f"output_dir={stopped}"])
    keys = ("iteration", "lm_loss", "grad_norm", "lr", "loss_scale", "loss_scale_overflows")  # not the timings
    assert [[r.get(k) for k in keys] for r in read_metrics(stopped)] == \
        [[r.get(k) for k in keys] for r in read_metrics(full)]
    assert read_metrics(full)[-1]["loss_scale_overflows"] < FP16_ITERS  # the steps compared include updates


def test_a_rerun_may_change_the_batch_size_and_refuses_what_it_cannot_continue(base, small_tokenizer_dir, tmp_path):
    """Stopped at iteration 3 after 3 x 8 samples. Rerun with global batches of 4: it reads on from sample 24
    to the end (a sampler sized for 6 x 4 samples ran dry before); of 16: refused, 24 samples are no whole
    number of its batches; with another optimizer: refused by name, before any data or model is built."""
    output = tmp_path / "run"
    run_pretrain_in_ranks(1, base + [f"output_dir={output}", f"train.exit_interval={STOP}"])
    for change, message in ((["train.global_batch_size=16"], "train.global_batch_size: .* has consumed 24 samples"),
                            (["parallel.distributed_optimizer=true"], "parallel.distributed_optimizer: the optimizer "
                                                                      "state of .* was saved with False")):
        refused = run_pretrain_in_ranks(1, base + [f"output_dir={output}"] + change, expect=2)
        assert re.search(message, refused.stderr), refused.stderr[-2000:]
    # two ranks of tensor parallelism padding the vocabulary to 768 rows, not the checkpoint's 512
    refused = run_pretrain_in_ranks(2, base + [f"output_dir={output}", "parallel.tensor=2",
                                               "model.make_vocab_size_divisible_by=192"], expect=2)
    assert "set model.make_vocab_size_divisible_by=32, which pads to 512" in refused.stderr, refused.stderr[-2000:]
    # a new output_dir continuing the run's count: the iterations to run come on top of its 3
    refused = run_pretrain_in_ranks(1, base + [f"output_dir={tmp_path / 'branch'}", f"checkpoint.load={output}",
                                               f"train.iters={STOP}"], expect=2)
    assert f"is at iteration {STOP}, and this run continues its count" in refused.stderr, refused.stderr[-2000:]
    rerun = run_pretrain_in_ranks(1, base + [f"output_dir={output}", "train.global_batch_size=4",
                                             f"checkpoint.load={tmp_path / 'elsewhere'}"])
    assert "(not checkpoint.load=" in rerun.stdout  # its own checkpoint, said so
    records = read_metrics(output)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert [r["consumed_samples"] for r in records] == [8, 16, 24, 28, 32, 36]
    # read on in the first run's order: drawn for its 48 samples, not the 36 the rerun reads to
    saved = read_train_state(output / CHECKPOINTS_DIR / "iter_0000006")
    assert saved["data_samples"] == 48
    assert saved["tokenizer"] == tokenizer_identity(str(small_tokenizer_dir))  # what its ids mean


@pytest.mark.parametrize("saved, overrides, expected", [
    (None, [], (48, 0)),                                                   # a new run: what it reads
    (None, ["train.planned_samples=100"], (100, 0)),                       # or planned further
    ({"data_samples": 48}, ["train.global_batch_size=4"], (48, 48)),       # reads less: the checkpoint's order
    ({"data_samples": 48}, ["train.iters=8"], (64, 48)),                   # lengthened: drawn anew
    ({"data_samples": 48, "changed": True}, ["train.global_batch_size=4"], (36, 0)),  # on other data: anew
])
def test_a_resumed_run_draws_its_data_order_for_its_checkpoints_samples(saved, overrides, expected):
    """megatron's order of a source read more than once depends on the training samples it is drawn for:
    a resumed run keeps its checkpoint's count unless it reads further, or reads other data."""
    from megadiff.config import build_config
    from megadiff.training.state import Start

    cfg = build_config({}, ["train.iters=6", "train.global_batch_size=8", *overrides])
    start = Start()
    if saved is not None:
        changes = ["data.prefix: 'web' -> 'books'"] if saved.pop("changed", False) else []
        start = Start(saved={"iteration": 3, "consumed_samples": 24, **saved}, continues=True, data_changes=changes)
    assert start.data_samples(cfg) == expected


def _planned_from(monkeypatch, saved_overrides: list[str], overrides: list[str], train_state: dict | None,
                  own: bool = True, path: Path = Path("iter_0000003")):
    """plan_start of a run with `overrides` whose output_dir holds a checkpoint (at `path`) of a run with
    `saved_overrides` (or, not `own`, whose checkpoint.load names one); a `train_state` of None: model-only."""
    from megadiff.config import build_config
    from megadiff.training import state

    saved_cfg = build_config({}, saved_overrides)
    monkeypatch.setattr(state, "_starting_checkpoint", lambda cfg: (path, own))
    monkeypatch.setattr(state, "checkpoint_config", lambda path: saved_cfg)
    monkeypatch.setattr(state, "read_train_state", lambda path: None if train_state is None else dict(train_state))
    monkeypatch.setattr(state, "saved_optimizer_format", lambda path: {"format": "reshardable"})
    cfg = build_config({}, overrides)
    return state.plan_start(cfg), cfg


def test_a_checkpoint_saved_before_data_samples_were_kept_reads_on_in_its_order(monkeypatch):
    """Its run drew the order for what it read to its own train.iters: the saved config says how many."""
    start, cfg = _planned_from(monkeypatch, ["train.iters=6", "train.global_batch_size=8"],
                               ["train.iters=6", "train.global_batch_size=4"], {"iteration": 3, "consumed_samples": 24})
    assert start.data_samples(cfg) == (48, 48)


def test_a_derived_model_setting_given_or_left_to_its_default_is_the_same_model(monkeypatch):
    """A recipe's explicit head_dim (the default's value) against a conversion's null: the same weights."""
    from megadiff.config import ConfigError

    state = {"iteration": 3, "consumed_samples": 24, "data_samples": 48}
    explicit = ["model.hidden_size=64", "model.num_attention_heads=4", "model.head_dim=8", "model.num_kv_heads=4",
                "model.ffn_hidden_size=192"]
    _planned_from(monkeypatch, explicit, ["model.hidden_size=64", "model.num_attention_heads=4"], state)
    for own, fix in ((True, "use a new output_dir"), (False, r"load a checkpoint of this model \(checkpoint.load\)")):
        with pytest.raises(ConfigError, match=r"another model \(model.num_attention_heads: 4 -> 8, model.num_kv_heads: "
                                              rf"4 -> 8, model.head_dim: 8 -> 4\); {fix}, or the checkpoint's model "
                                              r"settings \(model.num_attention_heads=4 model.num_kv_heads=4 "
                                              r"model.head_dim=8\)"):
            _planned_from(monkeypatch, explicit, ["model.hidden_size=64", "model.num_attention_heads=8"], state, own)


def test_a_resumed_layout_keeps_the_vocabulary_rows():
    """megatron would load an embedding padded to 216 rows into 240 (zero rows drawing probability
    from every token) when parallel.tensor doubles the padding multiple: refused, naming a padding
    multiple that keeps the rows where there is one."""
    from megadiff.config import ConfigError, build_config
    from megadiff.training.state import _check_same_vocabulary

    def config(vocab: int, multiple: int | None = None, tensor: int = 1):
        padding = [] if multiple is None else [f"model.make_vocab_size_divisible_by={multiple}"]
        return build_config({}, [f"model.vocab_size={vocab}", "model.num_attention_heads=4",
                                 f"parallel.tensor={tensor}", *padding], world_size=tensor)

    saved = config(200, 24)
    fix = "set model.make_vocab_size_divisible_by=12"
    for multiple, message in ((24, f"padded to 216 rows .* pad it to 240 .*: {fix}"), (1, f"pad it to 200 .*: {fix}")):
        with pytest.raises(ConfigError, match=message):
            _check_same_vocabulary(saved, config(200, multiple, tensor=2), "ckpt")
    _check_same_vocabulary(saved, config(200, 108, tensor=2), "ckpt")
    with pytest.raises(ConfigError, match="keep parallel.tensor=1"):
        _check_same_vocabulary(config(201, 1), config(201, tensor=2), "ckpt")
    # the 3B recipes' vocabulary padded by 128 before, by 32 now: the checkpoint's multiple, which keeps the rows
    # at larger tensor sizes too (100352 // 1 kept them at parallel.tensor=1 alone)
    with pytest.raises(ConfigError, match="set model.make_vocab_size_divisible_by=128, which pads to 100352 at "
                                          "parallel.tensor=1"):
        _check_same_vocabulary(config(100288, 128), config(100288, 32), "ckpt")
    with pytest.raises(ConfigError, match="set model.make_vocab_size_divisible_by=64, which pads to 384"):
        _check_same_vocabulary(config(300, 128), config(300, 128, tensor=2), "ckpt")
    # fewer tensor ranks: the step kept (256 at one rank), not the rows themselves
    with pytest.raises(ConfigError, match="set model.make_vocab_size_divisible_by=256, which pads to 32256 at "
                                          "parallel.tensor=1"):
        _check_same_vocabulary(config(32001, 128, tensor=2), config(32001, 128), "ckpt")


def test_a_continued_run_names_what_of_its_data_order_changed(monkeypatch):
    """consumed_samples is a position in the checkpoint's order: a rerun on other data, split, seed or
    length reads on from there in another order, which it says (a run starting afresh has nothing to say)."""
    from pathlib import Path

    from megadiff.config import build_config
    from megadiff.training import state

    monkeypatch.setattr(state, "_starting_checkpoint", lambda cfg: (Path("ckpt"), True))
    monkeypatch.setattr(state, "checkpoint_config", lambda path: build_config({}, ["data.prefix=web", "train.seed=1"]))
    monkeypatch.setattr(state, "read_train_state", lambda path: {"iteration": 3, "consumed_samples": 3})
    monkeypatch.setattr(state, "saved_optimizer_format", lambda path: {"format": "reshardable"})
    start = state.plan_start(build_config({}, ["data.prefix=web", "train.seed=1"]))
    assert start.continues and start.data_changes == []
    start = state.plan_start(build_config({}, ["data.blend=[0.5,web,0.5,books]", "data.prefix=web", "train.seed=2"]))
    assert start.data_changes == ["data.blend: [] -> [0.5, 'web', 0.5, 'books']", "train.seed: 1 -> 2"]


def test_a_data_prefix_given_from_the_working_directory_or_whole_is_the_same_data(monkeypatch, tmp_path):
    """A checkpoint's config read in another working directory gives its relative paths whole: the same files,
    which a rerun's config spelled otherwise took for another data order (and drew its samples from the start)."""
    from megadiff.config import build_config
    from megadiff.training import state

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(state, "_starting_checkpoint", lambda cfg: (Path("ckpt"), True))
    monkeypatch.setattr(state, "checkpoint_config", lambda path: build_config({}, ["data.prefix=data/web"]))
    monkeypatch.setattr(state, "read_train_state", lambda path: {"iteration": 3, "consumed_samples": 3})
    monkeypatch.setattr(state, "saved_optimizer_format", lambda path: {"format": "reshardable"})
    start = state.plan_start(build_config({}, [f"data.prefix={tmp_path / 'data' / 'web'}"]))
    assert start.continues and start.data_changes == []


def test_blend_weights_are_the_same_data_order_where_megatron_normalises_them_alike(monkeypatch, tmp_path):
    """megatron normalises data.blend's weights: [70, a, 30, b] draws the samples of [0.7, a, 0.3, b], which a rerun
    took for another data order (a warning, and its order drawn afresh). A change is said exactly where megatron's
    blended order differs."""
    from megadiff.config import build_config
    from megadiff.data.datasets import build_datasets
    from megadiff.training import state
    from tests.test_data_datasets import TOKENIZER, synthetic_documents, write_documents

    a, b = tmp_path / "a", tmp_path / "b"
    write_documents(a, synthetic_documents(100, seed=1))
    write_documents(b, synthetic_documents(100, seed=2))

    def blend_config(weights):
        return build_config({}, [f"data.blend=[{weights[0]},{a},{weights[1]},{b}]", "model.seq_length=16",
                                 "model.vocab_size=1024", f"data.cache_dir={tmp_path / 'cache'}", "data.split=1,0,0"])

    def megatron_order(cfg):
        train = build_datasets(cfg, TOKENIZER, (200, 0, 0), seed=0)[0]
        return train.dataset_index.tolist(), train.dataset_sample_index.tolist()

    saved = blend_config([70, 30])
    monkeypatch.setattr(state, "_starting_checkpoint", lambda cfg: (Path("ckpt"), True))
    monkeypatch.setattr(state, "checkpoint_config", lambda path: saved)
    monkeypatch.setattr(state, "read_train_state", lambda path: {"iteration": 3, "consumed_samples": 3})
    monkeypatch.setattr(state, "saved_optimizer_format", lambda path: {"format": "reshardable"})
    same_orders = {}
    for weights in ([70, 30], [0.7, 0.3], [7, 3], [60, 40]):
        rerun = blend_config(weights)
        same_orders[tuple(weights)] = megatron_order(rerun) == megatron_order(saved)
        assert (state.plan_start(rerun).data_changes == []) == same_orders[tuple(weights)], weights
    assert not same_orders[60, 40]  # weights that do change the order are still told


def test_a_continued_run_refuses_another_tokenizer_and_takes_a_copy_of_its_own(monkeypatch, small_tokenizer_dir,
                                                                               tmp_path):
    """The embeddings' rows stand for the checkpoint's token ids: another tokenizer of the vocabulary's size
    (every shape check passes it) reads text into other ids. A copy of it elsewhere is the same tokenizer."""
    from megadiff.config import ConfigError

    ours = tokenizer_identity(str(small_tokenizer_dir))
    saved = {"iteration": 3, "consumed_samples": 24, "data_samples": 48, "tokenizer": ours}
    copy = shutil.copytree(small_tokenizer_dir, tmp_path / "copy")
    start, _ = _planned_from(monkeypatch, [f"data.tokenizer={small_tokenizer_dir}"], [f"data.tokenizer={copy}"], saved)
    assert start.tokenizer == ours
    with pytest.raises(ConfigError, match=f"data.tokenizer: {copy} reads text into other ids than "):
        _planned_from(monkeypatch, [f"data.tokenizer={small_tokenizer_dir}"], [f"data.tokenizer={copy}"],
                      {**saved, "tokenizer": tokenizer_identity("o200k_base")})


def test_a_run_from_a_converted_checkpoint_refuses_another_tokenizer_of_its_vocabulary_size(
        monkeypatch, small_tokenizer_dir, tmp_path):
    """A model-only checkpoint (from-hf's, with its tokenizer copied under tokenizer/) holds no training state to
    record its tokenizer: a run from it with another tokenizer of the same size trained on, silently."""
    from megadiff.config import ConfigError
    from tests.conftest import kjv_verses, save_small_tokenizer

    converted = tmp_path / "converted"
    shutil.copytree(small_tokenizer_dir, converted / "tokenizer")
    other = save_small_tokenizer(tmp_path / "other", kjv_verses()[5000:10000])
    assert tokenizer_identity(str(other)) != tokenizer_identity(str(small_tokenizer_dir))
    monkeypatch.chdir(tmp_path)
    moved_from = [f"data.tokenizer={tmp_path / 'elsewhere' / 'tokenizer'}"]  # the checkpoint was moved since
    same, other_afresh = [f"data.tokenizer={small_tokenizer_dir}"], [f"data.tokenizer={other}",
                                                                     "checkpoint.reset_iteration=true"]
    # the Hugging Face directory it was converted from, with vocabulary files alone: hashed otherwise, read alike
    vocabulary_files = [f"data.tokenizer={vocabulary_files_of(small_tokenizer_dir, tmp_path / 'original')}"]
    assert tokenizer_identity(vocabulary_files[0].split("=")[1]) != tokenizer_identity(str(small_tokenizer_dir))
    for run in (same, other_afresh, vocabulary_files):
        start, _ = _planned_from(monkeypatch, moved_from, ["checkpoint.load=converted", *run], None, own=False,
                                 path=converted)
        assert not start.continues
    with pytest.raises(ConfigError, match=f"data.tokenizer: {other} reads text into other ids than "):
        _planned_from(monkeypatch, moved_from, ["checkpoint.load=converted", f"data.tokenizer={other}"], None,
                      own=False, path=converted)


def vocabulary_files_of(directory: Path, into: Path) -> Path:
    """A copy of a byte-level BPE tokenizer directory as GPT-2's vocab.json and merges.txt, without tokenizer.json."""
    model = json.loads((directory / "tokenizer.json").read_text())["model"]
    into.mkdir()
    (into / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    (into / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    special = dict.fromkeys(("eos_token", "bos_token", "unk_token"), "<|endoftext|>")
    (into / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", **special}))
    return into


def test_training_state_of_a_newer_version_is_refused_by_name(monkeypatch):
    from megadiff.checkpoint.format import CheckpointError

    with pytest.raises(CheckpointError, match=r"does not know \(tokens_seen\): it was saved by a newer version"):
        _planned_from(monkeypatch, [], [], {"iteration": 3, "consumed_samples": 24, "tokens_seen": 7})


def _pretrain_in(working_dir: Path, config: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(pretrain_command(1, overrides, config), cwd=working_dir, env=environment(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_a_run_resumed_with_its_config_yaml_from_another_directory_continues_it(small_tokenizer_dir, tmp_path,
                                                                               monkeypatch):
    """A run's config.yaml keeps output_dir and data.cache_dir as typed, from the directory the run started in:
    resumed with it from another (a Slurm job submitted elsewhere) it started a new run there, on the corpus
    prepared again there; an evaluation of its checkpoint read the data there."""
    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir()
    elsewhere.mkdir()
    relative = tiny_overrides(small_tokenizer_dir, Path("cache")) + [f"train.iters={ITERS}"]
    _pretrain_in(started, DEMO_CONFIG, relative + ["output_dir=full"])
    _pretrain_in(started, DEMO_CONFIG, relative + ["output_dir=part", f"train.exit_interval={STOP}"])
    rerun = _pretrain_in(elsewhere, started / "part" / "config.yaml", ["train.exit_interval=null"])
    assert "resumed from" in rerun.stdout, rerun.stdout[-3000:]
    assert losses(started / "part") == losses(started / "full")  # every iteration, bit for bit
    assert not list(elsewhere.iterdir())  # no run, no data there
    monkeypatch.chdir(elsewhere)
    saved = checkpoint_config(latest_checkpoint(started / "part" / CHECKPOINTS_DIR))
    assert (saved.output_dir, saved.data.cache_dir) == (str(started / "part"), str(started / "cache"))


@pytest.mark.parametrize("where", ["missing", "not-a-run"])
def test_a_checkpoint_load_that_names_no_checkpoint_is_a_config_error_naming_the_key(tmp_path, where):
    """A recipe's checkpoint.load (the 64K extension's 4K run), which the user may never have typed: the
    refusal names the setting, not just a path."""
    from megadiff.config import ConfigError, build_config
    from megadiff.training import state

    (tmp_path / "not-a-run").mkdir()
    cfg = build_config({}, [f"checkpoint.load={tmp_path / where}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=rf"^checkpoint\.load: .*{where}"):
        state.plan_start(cfg)
