"""One pre-training run seen from outside: its LR schedule, logs, evaluation, checkpoint rotation;
the 64K length extension from a shorter run; the demo config on a fresh checkout."""
from __future__ import annotations

import json
import math
import subprocess
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megadiff.analysis.scaling import run_points
from megadiff.checkpoint.format import CHECKPOINTS_DIR, checkpoint_config, read_latest_iteration
from megadiff.config import build_config, load_config
from megadiff.data.locations import corpus_dir, data_prefix
from megadiff.data.prepare import ensure_prepared, prepare
from megadiff.inference import load_checkpoint
from megadiff.inference.evaluate import evaluate
from megadiff.models.param_count import count_parameters
from megadiff.observability.metrics import read_metrics
from megadiff.training.pretrain import build_scheduler, lr_schedule_change, nothing_left_to_train
from megadiff.training.state import Start
from megadiff.training.throughput import peak_tflops_of
from tests.pretrain_runs import DEMO_CONFIG, ROOT, environment, losses, run_pretrain_in_ranks, tiny_overrides


@pytest.fixture(scope="module")
def base(small_tokenizer_dir, tmp_path_factory) -> list[str]:
    return tiny_overrides(small_tokenizer_dir, tmp_path_factory.mktemp("data-cache"))


def paper_lr(it: int, peak: float, low: float, warmup: int, total: int, style: str, wsd_decay: int = 0,
             wsd_style: str = "linear") -> float:
    """Linear warmup from 0 to the peak, then linear or cosine decay to the minimum at `total`; or
    (style "wsd") the peak until the last `wsd_decay` iterations, which decay to the minimum."""
    if it <= warmup:
        return peak * it / warmup
    if style == "wsd":
        if it <= total - wsd_decay:
            return peak
        style, progress = wsd_style, (it - (total - wsd_decay)) / wsd_decay
    else:
        progress = (it - warmup) / (total - warmup)
    factor = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
              "exponential": 2 * 0.5 ** progress - 1, "minus_sqrt": 1 - math.sqrt(progress)}[style]
    return low + (peak - low) * factor


def scheduled_lrs(cfg, iterations: int) -> list[float]:
    """The lr of each of the first `iterations` iterations, as the run's scheduler sets it."""
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_scheduler(cfg, optimizer)
    lrs = []
    for _ in range(iterations):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("style, wsd_style", [("linear", None), ("cosine", None), ("wsd", "linear"),
                                              ("wsd", "cosine"), ("wsd", "exponential"), ("wsd", "minus_sqrt")])
def test_schedule_follows_the_papers_formula(style, wsd_style):
    wsd = ["train.lr_wsd_decay_iters=30", f"train.lr_wsd_decay_style={wsd_style}"] if style == "wsd" else []
    cfg = build_config({}, ["train.lr=3e-4", "train.min_lr=1e-5", "train.lr_warmup_iters=10", "train.iters=100",
                            f"train.lr_decay_style={style}", *wsd])
    assert scheduled_lrs(cfg, 100) == pytest.approx(
        [paper_lr(it, 3e-4, 1e-5, 10, 100, style, wsd_decay=30, wsd_style=wsd_style) for it in range(1, 101)])


@pytest.mark.parametrize("overrides, decay", [
    (["train.min_lr=3e-4"], "linear"),  # min_lr == lr: a constant lr after the warmup
    (["train.lr_decay_style=wsd", "train.lr_wsd_decay_iters=90"], "wsd"),  # the decay fills all after the warmup
])
def test_schedules_at_the_bounds_the_config_check_accepts(overrides, decay):
    cfg = build_config({}, ["train.lr=3e-4", "train.min_lr=1e-5", "train.lr_warmup_iters=10", "train.iters=100",
                            *overrides])
    assert scheduled_lrs(cfg, 100) == pytest.approx(
        [paper_lr(it, 3e-4, cfg.train.min_lr, 10, 100, decay, wsd_decay=90, wsd_style="linear")
         for it in range(1, 101)])


def test_a_run_shorter_than_its_warmup_only_warms_up():
    """A recipe shortened for a trial (train.iters=3 of a 1000-iteration warmup) still builds megatron's
    schedule, which needs its decay to end after the warmup."""
    cfg = build_config({}, ["train.lr=3e-4", "train.lr_warmup_iters=1000", "train.iters=3"])
    assert scheduled_lrs(cfg, 3) == pytest.approx([3e-4 * it / 1000 for it in range(1, 4)])


@pytest.mark.slow
def test_a_wsd_run_stopped_in_its_stable_phase_continues_a_longer_schedule(base, tmp_path):
    """The WSD workflow: a run stopped at the peak lr is rerun with more iterations; the stable
    phase goes on and the decay moves to the new end."""
    out = tmp_path / "wsd"
    wsd = base + [f"output_dir={out}", "train.lr_decay_style=wsd", "train.lr_wsd_decay_iters=2", "train.min_lr=1e-4"]
    run_pretrain_in_ranks(1, wsd + ["train.iters=6", "train.exit_interval=3"])
    proc = run_pretrain_in_ranks(1, wsd + ["train.iters=8"])
    assert "resumed from" in proc.stdout and "the lr schedule differs" not in proc.stdout
    _assert_said_as_it_starts(proc.stdout, f"megadiff pretrain: loading {out / 'checkpoints' / 'iter_0000003'}")
    # the order of a source read more than once depends on the samples it was drawn for: said where it changes
    assert "this run draws its data order for 64 samples (what train.iters reads, or train.planned_samples), not " \
           "the 48 its checkpoint's was drawn for" in proc.stdout
    lrs = {r["iteration"]: r["lr"] for r in read_metrics(out) if "lm_loss" in r}
    assert sorted(lrs) == list(range(1, 9))
    for it, lr in lrs.items():
        assert lr == pytest.approx(paper_lr(it, 5e-3, 1e-4, 2, 8, "wsd", wsd_decay=2)), it
    assert lrs[6] == pytest.approx(5e-3) and lrs[8] == pytest.approx(1e-4)  # 6: the first schedule's end


@pytest.mark.slow
def test_a_finished_linear_run_lengthened_says_its_lr_jumps_up_the_stretched_decay(base, tmp_path):
    """A finished linear run (at min_lr) rerun with more iterations: the config's schedule, recomputed at the
    checkpoint's position, takes the lr back up the longer decay. The start says so, with both lrs, as the
    paper's formula gives them; the WSD extension above, whose lr goes on unchanged, says nothing."""
    out = tmp_path / "lengthened"
    linear = base + [f"output_dir={out}", "train.min_lr=1e-4"]
    run_pretrain_in_ranks(1, linear + ["train.iters=4"])
    proc = run_pretrain_in_ranks(1, linear + ["train.iters=8"])
    lrs = {r["iteration"]: r["lr"] for r in read_metrics(out) if "lm_loss" in r}
    was, now = paper_lr(4, 5e-3, 1e-4, 2, 4, "linear"), paper_lr(5, 5e-3, 1e-4, 2, 8, "linear")
    assert lrs[4] == pytest.approx(was) and lrs[5] == pytest.approx(now)
    assert (f"the lr schedule differs from the checkpoint's (train.iters: 4 -> 8): the lr goes from {was:.4g}, its "
            f"update 4's, to {now:.4g} at the next") in proc.stdout
    assert "train.lr_decay_iters=4 keeps where it ends" in proc.stdout
    # rerun with train.iters lowered below the checkpoint's iteration: nothing trained, and said
    proc = run_pretrain_in_ranks(1, linear + ["train.iters=6"])
    assert "train.iters=6: the run's checkpoint is already at iteration 8, past it: nothing is trained" in proc.stdout
    assert {r["iteration"]: r["lr"] for r in read_metrics(out) if "lm_loss" in r} == lrs


@pytest.mark.parametrize("iteration, said", [(99, None), (100, "nothing is left to train"),
                                             (120, "already at iteration 120, past it")])
def test_a_rerun_at_or_past_its_last_iteration_says_it_trains_nothing(iteration, said):
    start = Start(continues=True, saved={"iteration": iteration, "consumed_samples": 0})
    message = nothing_left_to_train(build_config({}, ["train.iters=100"]).train, start)
    assert message is None if said is None else said in message


WSD = ["train.lr_decay_style=wsd", "train.lr_wsd_decay_iters=20"]


@pytest.mark.parametrize("before, after, done, jump", [
    (["train.iters=100"], ["train.iters=200"], 100, (paper_lr(100, 3e-4, 1e-5, 10, 100, "linear"),
                                                     paper_lr(101, 3e-4, 1e-5, 10, 200, "linear"))),
    (["train.iters=100", *WSD], ["train.iters=200", *WSD], 90, (paper_lr(90, 3e-4, 1e-5, 10, 100, "wsd", 20), 3e-4)),
    (["train.iters=100"], ["train.iters=100", "train.lr=6e-4"], 50, (paper_lr(50, 3e-4, 1e-5, 10, 100, "linear"),
                                                                    paper_lr(51, 6e-4, 1e-5, 10, 100, "linear"))),
    (["train.iters=100", *WSD], ["train.iters=200", *WSD], 60, None),  # the stable phase lengthened
    (["train.iters=100", *WSD], ["train.iters=80", *WSD], 60, None),  # a decay branched off it at 60
    (["train.iters=100"], ["train.iters=200"], 0, None),  # nothing trained yet
    (["train.iters=100"], ["train.iters=200", "train.lr_decay_iters=100"], 100, None),  # the advice: at min_lr on
])
def test_a_continued_run_says_where_its_lr_schedule_jumps_from_its_checkpoints(before, after, done, jump):
    """Where the config's schedule, at the checkpoint's last update, is not where the checkpoint's schedule had
    the lr, the lr jumps at the next: said, with both lrs (the paper's formula's). The WSD workflows join on."""
    common = ["train.lr=3e-4", "train.min_lr=1e-5", "train.lr_warmup_iters=10"]
    start = Start(continues=True, saved={"scheduler": {"num_steps": done}},
                  checkpoint_train=build_config({}, common + before).train)
    said = lr_schedule_change(build_config({}, common + after).train, start)
    if jump is None:
        assert said is None
    else:
        assert f"the lr goes from {jump[0]:.4g}, its update {done}'s, to {jump[1]:.4g} at the next" in said


@pytest.mark.slow
def test_a_record_every_few_steps_reports_their_means(base, tmp_path):
    """logging.log_interval=2: each record's loss is the mean of its two steps' (as Megatron-LM logs), the
    same steps a run logging every one records, the run's last step (5) recorded alone. Stopped at 3,
    between two records, and resumed, the run records the same means."""
    every, pairs = tmp_path / "every", tmp_path / "pairs"
    run_pretrain_in_ranks(1, base + ["train.iters=5", f"output_dir={every}"])
    pairs_run = base + ["train.iters=5", "logging.log_interval=2", f"output_dir={pairs}"]
    run_pretrain_in_ranks(1, pairs_run + ["train.exit_interval=3"])
    assert [r["iteration"] for r in read_metrics(pairs)] == [2]
    run_pretrain_in_ranks(1, pairs_run)
    each = losses(every)
    assert [r["iteration"] for r in read_metrics(pairs)] == [2, 4, 5]
    assert losses(pairs) == pytest.approx([(each[0] + each[1]) / 2, (each[2] + each[3]) / 2, each[4]], rel=1e-6)


@pytest.fixture(scope="module")
def logged_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "logged"
    proc = run_pretrain_in_ranks(1, base + [f"output_dir={out}", "train.iters=6", "train.min_lr=1e-4",
                                            "train.eval_interval=4", "train.eval_iters=2", "checkpoint.save_interval=2",
                                            "checkpoint.keep_last=2", "checkpoint.async_save=true",
                                            "logging.tensorboard=true"])
    return out, proc


@pytest.mark.slow
def test_metrics_console_and_tensorboard(logged_run):
    out, proc = logged_run
    records = read_metrics(out)
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert r["lr"] == pytest.approx(paper_lr(r["iteration"], 5e-3, 1e-4, 2, 6, "linear"))
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0
        assert r["consumed_samples"] == 8 * r["iteration"]
        assert set(r["lambda"]) == {"layer_1", "layer_2"}
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]
    assert [r["iteration"] for r in records if "valid_loss" in r] == [4, 6]  # the trained model's too
    assert "iteration 6/6 | lm_loss" in proc.stdout
    assert "GiB on the most loaded rank" in proc.stdout  # the model-state memory, at the start
    assert f"starting from scratch; metrics and checkpoints in {out}" in proc.stdout  # where to look, at once
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert {"lm_loss", "lr", "grad_norm", "lambda/layer_1", "valid_loss"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("lm_loss")] == pytest.approx([r["lm_loss"] for r in train])


@pytest.mark.slow
def test_logged_lambdas_are_those_of_the_iterations_forward(logged_run):
    """Iteration 5's lambdas, logged with its loss, come from the weights iteration 4 saved."""
    out, _ = logged_run
    saved = load_checkpoint(out / CHECKPOINTS_DIR / "iter_0000004").gpt
    with torch.no_grad():
        expected = {f"layer_{layer.layer_number}": float(layer.self_attention.core_attention.current_lambda())
                    for layer in saved.decoder.layers}
    logged = next(r["lambda"] for r in read_metrics(out) if r["iteration"] == 5 and "lambda" in r)
    assert logged == pytest.approx(expected, rel=1e-6)
    assert logged != pytest.approx(next(r["lambda"] for r in read_metrics(out) if r["iteration"] == 4 and "lambda" in r))


def test_scaling_reads_the_runs_validation_losses(logged_run):
    """`megadiff scaling`'s points of a real run: by tokens every valid_loss it logged (8 sequences of
    32 tokens an iteration), by params the last one at the model's size."""
    out, _ = logged_run
    valid = [(r["iteration"], r["valid_loss"]) for r in read_metrics(out) if "valid_loss" in r]
    by_tokens = run_points(out, "tokens")
    assert [(p.iteration, p.x, p.loss, p.variant) for p in by_tokens] == [(it, it * 8 * 32, loss, "diff")
                                                                         for it, loss in valid]
    (by_size,) = run_points(out, "params")
    count = count_parameters(checkpoint_config(out).model)
    assert (by_size.iteration, by_size.loss) == valid[-1] and by_size.x == count.non_embedding + count.embedding


@pytest.mark.slow
def test_each_blended_source_is_validated_as_evaluate_scores_it(base, tmp_path):
    """train.eval_each_source: valid_loss/<name> for each prefix of a blend; at the last iteration
    each equals `megadiff evaluate` of the final checkpoint on that prefix (the same samples)."""
    cfg = load_config(DEMO_CONFIG, base)
    ensure_prepared(cfg)
    kjv = data_prefix(cfg.data)
    later = tmp_path / "later.jsonl"  # chapters 600-699 of the bundled corpus
    later.write_text("".join((corpus_dir(cfg.data) / "kjv.jsonl").read_text().splitlines(keepends=True)[600:700]))
    prepare(build_config(cfg.model_dump(mode="json"), [f"data.sources=[{later}]", f"data.prefix={tmp_path / 'later'}",
                                                       "data.bundled_corpus=null"]).data)
    out = tmp_path / "run"
    run_pretrain_in_ranks(1, base + [f"output_dir={out}", f"data.blend=[1,{kjv},3,{tmp_path / 'later'}]",
                                     "train.iters=2", "train.eval_interval=2", "train.eval_iters=2",
                                     "train.eval_each_source=true"])
    (valid,) = [r for r in read_metrics(out) if "valid_loss" in r]
    names = (f"valid_loss/{Path(kjv).name}", "valid_loss/later")
    assert set(valid) == {"iteration", "consumed_samples", "valid_loss", *names}
    report = tmp_path / "eval.json"
    assert evaluate(str(out), sequences=2 * 8, batch_size=4, output=str(report)) == 0
    sources = json.loads(report.read_text())["sources"]
    for name, source in zip(names, sources):
        assert source["sequences"] == 16
        assert valid[name] == pytest.approx(source["loss"], rel=1e-5)
    assert valid[names[0]] != pytest.approx(valid[names[1]], rel=1e-3)


@pytest.mark.slow
def test_profile_window_traces_each_profiling_rank(base, tmp_path):
    out = tmp_path / "profiled"
    proc = run_pretrain_in_ranks(2, base + [f"output_dir={out}", "train.iters=4", "logging.profile_iterations=[2,3]",
                                            "logging.profile_ranks=[0,1]"])
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"trace-rank{rank}-iters2-3.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert {name for name in names if name.startswith("megadiff iteration")} == {
            "megadiff iteration 2", "megadiff iteration 3"}
        assert "aten::scaled_dot_product_attention" in names  # the differential core attention (SDPA on CPU)
        ops = (out / "profile" / f"ops-rank{rank}-iters2-3.txt").read_text()
        assert "megadiff iteration 3" in ops and "aten::mm" in ops
        assert f"rank {rank}: profile written" in proc.stdout
    assert [r["iteration"] for r in read_metrics(out) if "lm_loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_checkpoints_rotate_and_carry_their_config(logged_run):
    out, _ = logged_run
    checkpoints = out / CHECKPOINTS_DIR
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    assert read_latest_iteration(checkpoints) == 6
    assert checkpoint_config(checkpoints / "iter_0000006").model.hidden_size == 64
    assert (out / "config.yaml").is_file()


def _assert_said_as_it_starts(stdout: str, action: str) -> None:
    """A start's step of minutes at scale is said before it begins, then with its time, before the run's first
    line: the log showed nothing until then."""
    lines = stdout.splitlines()
    begun = lines.index(f"{action} ...")
    assert re.fullmatch(rf"{re.escape(action)}: [0-9.]+ s", lines[begun + 1]), stdout
    assert begun + 1 < next(i for i, line in enumerate(lines) if line.startswith("megadiff pretrain: diff model"))


@pytest.mark.slow
def test_the_start_says_it_reads_the_data(logged_run):
    _assert_said_as_it_starts(logged_run[1].stdout,
                              "megadiff pretrain: reading the data (its sample indexes built on a first run)")


@pytest.mark.slow
def test_each_checkpoint_save_is_said_as_it_begins_and_ends(logged_run):
    """A large model's save takes minutes: the log showed nothing of it."""
    _, proc = logged_run
    lines = proc.stdout.splitlines()
    for saved in (2, 4, 6):  # checkpoint.save_interval=2 of 6 iterations
        begun = lines.index(f"iteration {saved}: saving a checkpoint")
        assert lines[begun - 1].startswith(f"iteration {saved}/6 | "), proc.stdout  # after its records
        assert re.fullmatch(rf"iteration {saved}: checkpoint handed to the background writer in [0-9.]+ s",
                            lines[begun + 1]), proc.stdout


@pytest.mark.slow
def test_checkpoints_carry_a_tokenizer_of_files(logged_run, small_tokenizer_dir, tmp_path):
    """generate and to-hf read the checkpoint's copy: the directory data.tokenizer names may be gone (a from-hf
    checkpoint, deleted once the run continuing it had begun)."""
    from megadiff.checkpoint.single_process import checkpoint_tokenizer
    from megadiff.data.manifest import tokenizer_identity

    checkpoint = logged_run[0] / CHECKPOINTS_DIR / "iter_0000006"
    assert tokenizer_identity(str(checkpoint / "tokenizer")) == tokenizer_identity(str(small_tokenizer_dir))
    cfg = checkpoint_config(checkpoint)
    gone = cfg.model_copy(update={"data": cfg.data.model_copy(update={"tokenizer": str(tmp_path / "gone")})})
    assert checkpoint_tokenizer(checkpoint, gone).encode("And God said") == \
        checkpoint_tokenizer(checkpoint, cfg).encode("And God said")


@pytest.mark.slow
def test_64k_style_extension_from_a_shorter_run(base, logged_run, tmp_path):
    """The extension recipe's mechanics at toy scale: load the short run, then longer sequences,
    RoPE theta 640,000, length up-sampled data and context parallelism, with a fresh schedule."""
    short, _ = logged_run
    out = tmp_path / "extended"
    proc = run_pretrain_in_ranks(2, base + [f"output_dir={out}", f"checkpoint.load={short}",
                                            "checkpoint.reset_iteration=true", "model.seq_length=64",
                                            "model.rope_theta=640000", "data.length_upsampling=true",
                                            "parallel.context=2", "train.iters=2", "train.lr=8e-4"])
    assert f"initialised from {short / CHECKPOINTS_DIR / 'iter_0000006'}" in proc.stdout
    assert "the model's positions differ from the checkpoint's (model.seq_length: 32 -> 64; model.rope_theta: " \
        in proc.stdout
    # the new phase's own schedule (warmup to 8e-4), not the short run's peak of 5e-3 its optimizer state carried
    assert [r["lr"] for r in read_metrics(out) if "lm_loss" in r] == pytest.approx([4e-4, 8e-4])
    extended = losses(out)
    assert len(extended) == 2 and all(math.isfinite(x) for x in extended)
    # the trained weights were loaded: far below a fresh model's loss (about ln 512 = 6.24)
    fresh = losses(short)[0]
    assert extended[0] < fresh - 0.3
    saved = checkpoint_config(out / CHECKPOINTS_DIR / "iter_0000002")
    assert (saved.model.seq_length, saved.model.rope_theta) == (64, 640000)


@pytest.mark.slow
def test_demo_end_to_end_from_nothing(tmp_path):
    """`megadiff demo` (what `make demo` runs), shortened: its own config (cl100k_base, the bundled
    KJV corpus prepared on first use), pre-training, conversion to stock DiffLlama, a sample; the
    run's directory given as any override of the demo config is."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "megadiff", "demo", f"output_dir={out}",
                           f"data.cache_dir={tmp_path / 'cache'}", "train.iters=2", "train.eval_interval=null"],
                          env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert read_latest_iteration(out / CHECKPOINTS_DIR) == 2
    # a packaged encoding is named, not copied (an HF conversion of it would be read in its place)
    assert not (out / CHECKPOINTS_DIR / "iter_0000002" / "tokenizer").exists()
    assert list((tmp_path / "cache").rglob("*.bin"))
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "diffllama"
    sample = proc.stdout.split("a sample from the Hugging Face model")[1]
    assert "In the beginning God" in sample and "check passed" in proc.stdout


@pytest.mark.parametrize("device_name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H800 PCIe", 756.0),
    ("NVIDIA B200", 2250.0), ("NVIDIA GB200", 2500.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA GeForce RTX 4090", None)])
def test_mfu_peak_is_the_most_specific_known_device(device_name, peak):
    assert peak_tflops_of(device_name) == peak


def test_commands_write_their_output_where_the_gpu_runner_asks(tmp_path, monkeypatch):
    """bench/run_on_gpu.sh sets $MEGADIFF_TEST_OUTPUT_DIR: a stage its time limit kills keeps each command's
    output so far (its test's captured output dies with it)."""
    from tests.pretrain_runs import OUTPUT_DIR_ENV, run_command

    monkeypatch.setenv(OUTPUT_DIR_ENV, str(tmp_path / "commands"))
    proc = run_command([sys.executable, "-m", "megadiff", "params", str(DEMO_CONFIG), "--world-size", "nine"], 120)
    assert proc.returncode == 2 and "'nine' is not a whole number" in proc.stderr
    (out,) = (tmp_path / "commands").glob("*-params.out")
    assert out.read_text() == proc.stdout and out.with_suffix(".err").read_text() == proc.stderr


def test_throughput_counts_every_token_and_divides_the_flops_among_the_devices():
    """tokens/s, TFLOP/s per device and MFU as the formula gives them: global batch x window tokens an
    iteration, the model's FLOPs at its tensor-parallel size (its padded vocabulary), shared by every device,
    against the configured peak (not the built-in table's, nor none off a GPU)."""
    from megadiff.models.param_count import training_flops_per_token
    from megadiff.training.throughput import Throughput

    cfg = build_config({}, ["model.vocab_size=300", "parallel.tensor=2", "train.global_batch_size=8",
                            "model.seq_length=64", "logging.peak_tflops=0.5"], 4)
    per_token = training_flops_per_token(cfg.model, tensor_parallel=2)
    assert per_token != training_flops_per_token(cfg.model, tensor_parallel=1)  # 384 rows at TP 1, 512 at TP 2
    record = Throughput(cfg, world_size=4).metrics(seconds=2.0)
    tokens = 8 * 64
    assert record["tokens_per_s"] == pytest.approx(tokens / 2.0)
    assert record["tflops_per_device"] == pytest.approx(per_token * tokens / 2.0 / 4 / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] / 0.5)


def test_a_blended_source_smaller_than_its_share_is_said_to_be_read_several_times(base, tmp_path, capsys):
    """megatron reads a source asked for more samples than its train split holds in epochs: a small corpus given
    half the blend was read over and over, and the run said nothing of it."""
    from megadiff.cli import main
    from megadiff.data.indexed import token_count
    from tests.conftest import kjv_verses

    verses = kjv_verses()
    prefixes = {}
    for name, texts in (("large", verses[:3000]), ("small", verses[3000:3020])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        prefixes[name] = tmp_path / "prepared" / name
        assert main(["prepare-data", str(DEMO_CONFIG), *base, "data.bundled_corpus=null",
                     f"data.sources=[{tmp_path / name}]", f"data.prefix={prefixes[name]}"]) == 0
    capsys.readouterr()
    iters, batch, seq = 10, 8, 32  # tiny_overrides' global batch and sequence length
    assert main(["pretrain", str(DEMO_CONFIG), *base, "data.bundled_corpus=null", "data.split=1,0,0",
                 f"data.blend=[1,{prefixes['large']},1,{prefixes['small']}]", f"train.iters={iters}",
                 f"output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    # one pass over a split of n tokens gives (n - 1) // seq samples (each reads seq + 1 tokens)
    distinct = {name: (token_count(str(prefix)) - 1) // seq for name, prefix in prefixes.items()}
    share = iters * batch // 2
    assert distinct["small"] < share < distinct["large"]
    said = [line for line in out.splitlines() if "distinct samples" in line and "train split" in line]
    assert len(said) == 1, out
    assert f"the train split of {prefixes['small']} holds {distinct['small']:,} distinct samples" in said[0]


def test_a_run_that_never_evaluates_needs_no_valid_split(base, tmp_path, capsys):
    """Without train.eval_interval no validation set is read, yet a prefix whose valid split held less than one
    sample (a small source of a blend at data.split=969,30,1) was refused; the run trains as one without the split."""
    from megadiff.cli import main
    from megadiff.data.checks import split_documents
    from megadiff.data.indexed import read_index
    from tests.conftest import kjv_verses
    from tests.pretrain_runs import losses

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in kjv_verses()[:100]))
    seq = 200
    data = [*base, "data.bundled_corpus=null", f"data.sources=[{tmp_path / 'corpus'}]",
            f"data.prefix={tmp_path / 'prepared'}", f"model.seq_length={seq}", "train.iters=2"]
    assert main(["prepare-data", str(DEMO_CONFIG), *data]) == 0
    splits = {split: split_documents(read_index(str(tmp_path / "prepared")), split)
              for split in ("969,30,1", "969,0,31")}
    assert splits["969,30,1"]["valid"][2] < seq + 1  # less than a sample
    assert splits["969,30,1"]["train"] == splits["969,0,31"]["train"]  # the same training documents
    for split in splits:
        assert main(["pretrain", str(DEMO_CONFIG), *data, f"data.split={split}", "train.eval_interval=null",
                     f"output_dir={tmp_path / split}"]) == 0, capsys.readouterr().err[-3000:]
    assert losses(tmp_path / "969,30,1") == losses(tmp_path / "969,0,31")
    assert len(losses(tmp_path / "969,0,31")) == 2


def interrupted_inside_the_profile_window(rank: int, world_size: int, overrides: list[str], report: str) -> None:
    """A run interrupted (Ctrl-C) at its second iteration, inside its profiling window, in this process (a
    notebook's, which keeps the exception and its traceback): reports whether torch's profiler is on before the
    run and after it."""
    import megadiff.training.pretrain as pretrain_module

    trained, steps = pretrain_module.train_step, []

    def interrupted_at_the_second(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt
        return trained(*args, **kwargs)

    pretrain_module.train_step = interrupted_at_the_second
    enabled, interruptions = [torch.autograd._profiler_enabled()], []
    try:
        pretrain_module.pretrain(load_config(DEMO_CONFIG, overrides))
    except KeyboardInterrupt as error:
        interruptions.append(error)  # held, with its traceback's frames, as sys.last_value holds it
    enabled.append(torch.autograd._profiler_enabled())
    Path(report).write_text(json.dumps({"interrupted": len(interruptions), "profiler on": enabled}))


def test_a_run_stopped_inside_its_profile_window_turns_the_profiler_off(base, tmp_path):
    """Left on, torch's profiler recorded every later op of the process in memory (a notebook's next runs)."""
    from tests.distributed import run_ranks

    report = tmp_path / "report.json"
    run_ranks(1, interrupted_inside_the_profile_window,
              base + [f"output_dir={tmp_path / 'run'}", "train.iters=4", "logging.profile_iterations=[1,3]"],
              str(report))
    assert json.loads(report.read_text()) == {"interrupted": 1, "profiler on": [False, False]}
