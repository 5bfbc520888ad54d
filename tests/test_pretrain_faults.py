"""What goes wrong in long runs: preemption signals, NaN losses, a crash in the middle of a save."""
from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, read_latest_iteration, saved_iterations
from megadiff.observability.metrics import read_metrics
from megadiff.preemption import REQUEUE_EXIT_CODE, REQUEUE_MARKER_ENV
from tests.distributed import run_ranks
from tests.pretrain_faults import (
    disk_full_while_saving, killed_while_saving, loaded_while_its_run_saves, marker_refused_while_committing,
    poisoned_on_the_last_rank, poisoned_run, resumed_with_a_load_transient, signalled_while_evaluating,
    signalled_while_starting,
)
from tests.pretrain_runs import (
    DEMO_CONFIG, ROOT, environment, losses, pretrain_command, run_pretrain_in_ranks, tiny_overrides,
)
from tests.wandb_log import exit_codes

LONG = 10_000  # iterations: far more than a test runs before its signal arrives


@pytest.fixture(scope="module")
def base(small_tokenizer_dir, tmp_path_factory) -> list[str]:
    return tiny_overrides(small_tokenizer_dir, tmp_path_factory.mktemp("data-cache"))


def _start(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(pretrain_command(2, overrides), env=environment(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_iteration(output_dir, iteration: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-3000:]}"
        path = output_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= iteration:
            return
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"iteration {iteration} not reached")


def _worker_of_rank(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "megadiff" in " ".join(child.cmdline()):
            return child
    raise LookupError(f"no worker with RANK={rank}")


def _stopped_at(proc: subprocess.Popen, output_dir) -> int:
    output = proc.communicate(timeout=120)[0]
    stopped = read_latest_iteration(output_dir / CHECKPOINTS_DIR)
    assert f"checkpointing at iteration {stopped}" in output, output[-3000:]
    assert len(read_metrics(output_dir)) == stopped  # no rank ran ahead and logged more
    return stopped


@pytest.mark.slow
def test_preemption_under_torchrun_checkpoints_and_resumes_exactly(base, tmp_path):
    run = base + [f"train.iters={LONG}", "train.lr_decay_style=constant"]
    out = tmp_path / "preempted"
    # SIGUSR1 to one worker only: the flag is all-reduced, so both ranks stop after the same iteration
    first = _start(run + [f"output_dir={out}"])
    _wait_for_iteration(out, 2, first)
    _worker_of_rank(first, 1).send_signal(signal.SIGUSR1)
    stopped = _stopped_at(first, out)
    # SIGTERM to torchrun itself, which forwards it to every worker (as Slurm's scancel does)
    second = _start(run + [f"output_dir={out}"])
    _wait_for_iteration(out, stopped + 2, second)
    second.send_signal(signal.SIGTERM)
    stopped_again = _stopped_at(second, out)
    assert stopped_again > stopped
    # a time budget spent before the first iteration ends: a checkpoint after it, exit code 0
    budget = run_pretrain_in_ranks(2, run + [f"output_dir={out}", "train.exit_duration_minutes=1e-6"])
    assert f"spent: checkpointing at iteration {stopped_again + 1}," in budget.stdout + budget.stderr
    assert read_latest_iteration(out / CHECKPOINTS_DIR) == stopped_again + 1
    end = stopped_again + 3
    run_pretrain_in_ranks(2, run + [f"output_dir={out}", f"train.exit_interval={end}"])
    reference = tmp_path / "uninterrupted"
    run_pretrain_in_ranks(2, run + [f"output_dir={reference}", f"train.exit_interval={end}"])
    assert losses(out) == losses(reference)
    assert len(losses(out)) == end


def test_preemption_reaching_every_process_of_the_step_checkpoints(base, tmp_path):
    """`scancel --signal=USR1` (slurm/job.sh) and the time limit's SIGTERM signal every process of the step:
    the loader workers, and the manager process megatron's checkpoint writes report through (once a periodic
    save had started it, its death failed the preemption checkpoint)."""
    out = tmp_path / "workers"
    launcher = subprocess.Popen(pretrain_command(1, base + [f"train.iters={LONG}", "train.dataloader_workers=2",
                                                            "checkpoint.save_interval=1", f"output_dir={out}"]),
                                env=environment(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_iteration(out, 2, launcher)
    trainer = psutil.Process(launcher.pid)
    helpers = trainer.children(recursive=True)
    assert len(helpers) >= 3  # two loader workers and the checkpoints' manager
    for process in [trainer, *helpers]:
        process.send_signal(signal.SIGUSR1)
    stopped = _stopped_at(launcher, out)
    assert launcher.returncode == REQUEUE_EXIT_CODE and stopped >= 2
    assert not list((out / CHECKPOINTS_DIR).glob("*.partial"))


@pytest.mark.parametrize("in_evaluation", [False, True], ids=["training", "evaluation"])
def test_a_run_failing_with_loader_workers_exits(base, tmp_path, in_evaluation):
    """An unexpected error (a CUDA or NCCL error) ends the process with its traceback. The loader's workers
    ignore SIGTERM (preemption reaches them too), and multiprocessing's exit handler, which terminates them and
    then joins them, waited forever on a loader the error's traceback still held: the job hung until its time
    limit. The same for the validation set's loader, an error while evaluating."""
    overrides = base + ["train.iters=5", "train.dataloader_workers=1", f"output_dir={tmp_path / 'crashed'}",
                        "train.eval_interval=1", "train.eval_iters=1"]
    crash = f"from tests.pretrain_faults import crashing_at_step; crashing_at_step(2, {overrides!r}, {in_evaluation})"
    proc = subprocess.run([sys.executable, "-c", crash], env=environment(), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "RuntimeError: an unexpected failure at step 2" in proc.stderr, proc.stderr[-3000:]


def test_a_background_save_an_error_left_uncommitted_is_removed_as_the_rerun_starts(base, tmp_path):
    """An unexpected error (a CUDA error's stand-in) at step 5, iteration 4's background save written but never
    committed (its commit runs at the next step): the rerun resumed from iteration 2 without a word, the partial
    files left until its first save. It removes them as it starts, says so, and trains as the uninterrupted run."""
    out = tmp_path / "crashed"
    run = base + ["train.iters=6", "checkpoint.save_interval=2", "checkpoint.keep_last=2", "checkpoint.async_save=true"]
    crash = f"from tests.pretrain_faults import crashing_at_step; crashing_at_step(5, {run + [f'output_dir={out}']!r})"
    proc = subprocess.run([sys.executable, "-c", crash], env=environment(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert "RuntimeError: an unexpected failure at step 5" in proc.stderr, proc.stderr[-3000:]
    checkpoints = out / CHECKPOINTS_DIR
    assert read_latest_iteration(checkpoints) == 2 and (checkpoints / "iter_0000004.partial").is_dir()
    rerun = run_pretrain_in_ranks(1, run + [f"output_dir={out}"])
    assert f"removed iter_0000004.partial from {checkpoints}: a save the last run began and never committed" in \
        rerun.stdout and f"resumed from {checkpoints / 'iter_0000002'}" in rerun.stdout, rerun.stdout[-3000:]
    assert saved_iterations(checkpoints) == [4, 6] and not list(checkpoints.glob("*.partial"))
    reference = tmp_path / "reference"
    run_pretrain_in_ranks(1, run + [f"output_dir={reference}"])
    assert losses(out) == losses(reference)


def test_a_checkpoint_loaded_from_a_run_still_training_is_kept_until_loaded(base, tmp_path):
    """checkpoint.load of a run that trains on with keep_last=1 (a decay or a length extension branched off it):
    that run committed a newer checkpoint while this one built its data and model, removed the one this run had
    chosen, and the load failed minutes into the start, calling the checkpoint cut short. It is kept until
    loaded (removed at that run's next save), and the branch trains as one started without the concurrent save."""
    source = tmp_path / "source"
    run_pretrain_in_ranks(1, base + ["train.iters=2", f"output_dir={source}"])
    reference, report = tmp_path / "reference", tmp_path / "report.json"
    branch = base + ["train.iters=4", f"checkpoint.load={source}"]
    run_pretrain_in_ranks(1, branch + [f"output_dir={reference}"])
    run_ranks(1, loaded_while_its_run_saves, branch + [f"output_dir={tmp_path / 'branch'}"],
              str(source / CHECKPOINTS_DIR), str(report))
    result = json.loads(report.read_text())
    assert result["exit_code"] == 0, result["stderr"][-3000:]
    assert losses(tmp_path / "branch") == losses(reference)
    assert saved_iterations(source / CHECKPOINTS_DIR) == [2, 3] and read_latest_iteration(source / CHECKPOINTS_DIR) == 3


def test_a_second_run_on_a_directory_in_use_is_refused(base, tmp_path, capsys):
    """Two runs on one output_dir (launched twice, a requeued job whose predecessor still runs) wrote their
    checkpoints and metrics among each other's, and the second resumed from the first's: rank 0 holds the
    directory's lock while a run lasts, and a run started meanwhile is refused before it writes anything."""
    from megadiff.cli import main
    from megadiff.rank_agreement import RUN_LOCK
    from tests.conftest import lock_held_elsewhere

    run = tmp_path / "run"
    with lock_held_elsewhere(run / RUN_LOCK) as pid:
        assert main(["pretrain", str(DEMO_CONFIG), *base, "train.iters=1", f"output_dir={run}"]) == 2
        refusal = capsys.readouterr().err
        assert f"output_dir {run} is in use by another run (host " in refusal and f", pid {pid})" in refusal
        assert [path.name for path in run.iterdir()] == [RUN_LOCK]
    assert main(["pretrain", str(DEMO_CONFIG), *base, "train.iters=1", f"output_dir={run}"]) == 0
    assert len(read_metrics(run / "metrics.jsonl")) == 1


def test_every_rank_of_a_second_run_is_refused_together(base, tmp_path):
    """Rank 0 alone holds the lock: the other ranks must hear of the refusal from it and end with its message,
    not fail apart (or wait for rank 0 in a collective until the timeout)."""
    from megadiff.rank_agreement import RUN_LOCK
    from tests.conftest import lock_held_elsewhere

    run = tmp_path / "run"
    with lock_held_elsewhere(run / RUN_LOCK):
        proc = run_pretrain_in_ranks(2, [*base, "train.iters=1", f"output_dir={run}"], timeout=120, expect=2)
    assert proc.stderr.count(f"output_dir {run} is in use by another run") == 2, proc.stderr[-3000:]


def test_a_resumed_run_says_its_data_was_prepared_again(base, tmp_path, capsys):
    """Data prepared again under its prefix (files added to its sources) is another data order, which a resumed
    run read on in without a word, where changing the keys that draw the order is said."""
    from megadiff.cli import main
    from tests.conftest import kjv_verses

    corpus, prefix = tmp_path / "corpus", tmp_path / "prepared" / "kjv"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": verse}) + "\n" for verse in kjv_verses()[:150]))
    data = ["data.bundled_corpus=null", f"data.sources=[{corpus}]", f"data.prefix={prefix}"]
    run = base + data + [f"output_dir={tmp_path / 'run'}"]
    said = "the data differs from what the checkpoint trained on"
    assert main(["prepare-data", str(DEMO_CONFIG), *base, *data]) == 0
    for iters in (1, 2):
        assert main(["pretrain", str(DEMO_CONFIG), *run, f"train.iters={iters}"]) == 0
        assert said not in "".join(capsys.readouterr())
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": verse}) + "\n" for verse in kjv_verses()[150:300]))
    assert main(["prepare-data", str(DEMO_CONFIG), *base, *data]) == 0
    capsys.readouterr()
    assert main(["pretrain", str(DEMO_CONFIG), *run, "train.iters=3"]) == 0
    assert f"{said} ({prefix}: prepared again since): this run reads on from sample 16 " in capsys.readouterr().out
    # a checkpoint an earlier megadiff saved, without the record: said, where nothing was
    import torch

    from megadiff.checkpoint.format import iteration_dir
    from megadiff.checkpoint.training_checkpoint import TRAIN_STATE_KEY

    common = iteration_dir(tmp_path / "run" / CHECKPOINTS_DIR, 3) / "common.pt"
    saved = torch.load(common, weights_only=False)
    del saved[TRAIN_STATE_KEY]["data"]
    torch.save(saved, common)
    assert main(["pretrain", str(DEMO_CONFIG), *run, "train.iters=4"]) == 0
    assert "the checkpoint keeps no record of the data it trained on" in capsys.readouterr().out


def test_a_run_starting_on_data_being_prepared_is_refused_naming_it(base, tmp_path, capsys, monkeypatch):
    """prepare-data replacing a prefix while a run opened it: the run said the files were missing ("prepare the
    data first"), or failed reading them after its datasets were built. Refused now, naming the lock."""
    from megadiff.cli import main
    from megadiff.files import exclusive_lock
    from tests.conftest import kjv_verses

    corpus, prefix = tmp_path / "corpus", tmp_path / "prepared" / "kjv"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": verse}) + "\n" for verse in kjv_verses()[:150]))
    data = ["data.bundled_corpus=null", f"data.sources=[{corpus}]", f"data.prefix={prefix}"]
    assert main(["prepare-data", str(DEMO_CONFIG), *base, *data]) == 0
    run = [*base, *data, f"output_dir={tmp_path / 'run'}", "train.iters=1"]
    from megadiff.data import prepare

    monkeypatch.setattr(prepare, "WAIT_FOR_PREPARING_SECONDS", 1)
    with exclusive_lock(f"{prefix}.lock"):  # what prepare-data holds while it writes
        assert main(["pretrain", str(DEMO_CONFIG), *run]) == 2
    assert (f"data.prefix: {prefix} is being prepared (a process preparing it, prepare-data or a run's bundled "
            f"corpus, holds {prefix}.lock): run again once it ends" in capsys.readouterr().err)
    # held for a moment (another process finding the data up to date): waited for
    import threading

    monkeypatch.setattr(prepare, "WAIT_FOR_PREPARING_SECONDS", 60)
    taken = threading.Event()

    def hold_a_moment():
        with exclusive_lock(f"{prefix}.lock"):
            taken.set()
            time.sleep(5)  # past the run's start-up, into its wait

    holder = threading.Thread(target=hold_a_moment)
    holder.start()
    taken.wait()
    assert main(["pretrain", str(DEMO_CONFIG), *run]) == 0
    holder.join()


def test_a_signal_while_the_run_starts_requeues_it_once_its_checkpoint_is_committed(base, tmp_path, monkeypatch):
    """SIGUSR1 on both ranks before anything is built (minutes at scale): the default action killed
    the ranks and failed the job; the run now takes its first step, checkpoints it and exits 75,
    leaving slurm/job.sh's requeue marker. A checkpoint that cannot be written leaves none: the job
    ends with the error rather than requeueing into it."""
    marker = tmp_path / "requeue"
    monkeypatch.setenv(REQUEUE_MARKER_ENV, str(marker))
    report, output = tmp_path / "report.json", tmp_path / "started"
    run_ranks(2, signalled_while_starting, base + ["train.iters=50", "checkpoint.async_save=true",
                                                   f"output_dir={tmp_path / 'disk-full'}"], str(report), True)
    disk_full = json.loads(report.read_text())
    assert disk_full["exit_code"] == 3 and "No space left on device" in disk_full["stderr"]
    assert not marker.exists()
    run_ranks(2, signalled_while_starting, base + ["train.iters=50", f"output_dir={output}"], str(report))
    assert json.loads(report.read_text())["exit_code"] == REQUEUE_EXIT_CODE
    assert read_latest_iteration(output / CHECKPOINTS_DIR) == 1 and len(read_metrics(output)) == 1
    assert marker.exists()


def test_a_signal_while_evaluating_stops_before_the_evaluation_s_next_batch(base, tmp_path):
    """An evaluation (train.eval_iters batches, minutes at scale) ran to its end before the stop a signal asked for,
    past the scheduler's grace: the job was killed without its checkpoint. Every rank now leaves it at the same
    batch, logs no valid_loss of it, checkpoints the iteration and exits 75."""
    report, output = tmp_path / "report.json", tmp_path / "evaluating"
    run_ranks(2, signalled_while_evaluating, base + ["train.iters=5", "train.eval_interval=1", "train.eval_iters=50",
                                                     f"output_dir={output}"], str(report))
    assert json.loads(report.read_text())["exit_code"] == REQUEUE_EXIT_CODE
    assert [int((tmp_path / f"report.json.batches.{rank}").read_text()) for rank in (0, 1)] == [1, 1]
    assert read_latest_iteration(output / CHECKPOINTS_DIR) == 1
    assert [record["iteration"] for record in read_metrics(output)] == [1]
    assert not any("valid_loss" in record for record in read_metrics(output))


def test_a_step_without_loss_tokens_is_recorded_without_a_loss_and_not_applied(base, tmp_path):
    """Its loss was 0.0, recorded and averaged, and the optimizer stepped on its zero gradients. The reference
    for the means: the same run recorded every step."""
    report, records = tmp_path / "report.json", {}
    for interval in (1, 2):
        run_ranks(1, poisoned_run, base + ["train.iters=4", f"logging.log_interval={interval}",
                                           f"output_dir={tmp_path / str(interval)}"], [2], str(report),
                  math.nan, False, True)  # masked
        records[interval] = read_metrics(tmp_path / str(interval))
    events, each = json.loads(report.read_text())["events"], records[1]
    assert [(event["updated"], event["params_changed"]) for event in events] == [(True, True), (False, False),
                                                                               (True, True), (True, True)]
    assert "lm_loss" not in each[1] and each[1]["no_loss_tokens"] is True
    assert [r["skipped_iterations"] for r in each] == [0] * 4
    assert each[1]["lr"] == each[2]["lr"]  # the schedule follows the updates
    assert [r["lm_loss"] for r in records[2]] == pytest.approx(
        [each[0]["lm_loss"], (each[2]["lm_loss"] + each[3]["lm_loss"]) / 2])


def test_the_memory_peaks_are_the_training_s_not_the_checkpoint_load_s(base, tmp_path):
    """The GPU's high-water marks were never reset: every record of a resumed run reported the moment its
    checkpoint's load held the loaded optimizer state beside the optimizer's own. The reference: what the
    (fake) GPU holds through training."""
    gib, report = 2 ** 30, tmp_path / "exit_code"
    held, output = 2 * gib, [f"output_dir={tmp_path / 'run'}", "checkpoint.save_interval=2"]
    for iters in (2, 4):  # the second resumes from the first's checkpoint
        run_ranks(1, resumed_with_a_load_transient, base + output + [f"train.iters={iters}"], held, 3 * gib,
                  str(report))
        assert report.read_text() == "0"
    peaks = [r["max_memory_allocated_gib"] for r in read_metrics(tmp_path / "run")]
    assert peaks == [held / gib] * 4


@pytest.mark.slow
def test_non_finite_steps_are_skipped_counted_and_bounded(base, tmp_path):
    report = tmp_path / "report.json"
    run_ranks(1, poisoned_run, base + ["train.iters=6", f"output_dir={tmp_path / 'skips'}"], [2, 4], str(report))
    result = json.loads(report.read_text())
    assert result["exit_code"] == 0
    for event in result["events"]:
        poisoned = event["iteration"] in (2, 4)
        assert event["updated"] is not poisoned and event["params_changed"] is not poisoned, event
    records = read_metrics(tmp_path / "skips")
    assert [r["skipped_iterations"] for r in records] == [0, 1, 1, 2, 2, 2]
    assert math.isnan(records[1]["lm_loss"]) and math.isfinite(records[-1]["lm_loss"])
    # the LR schedule follows the updates (as megatron's): a skipped step's lr is the next one's
    lrs = [r["lr"] for r in records]
    assert lrs[1] == lrs[2] != lrs[3] == lrs[4] != lrs[5] and lrs[0] != lrs[1]
    # a record every 2 steps: the means of the updating steps since the last one; a skipped step between
    # records alone, as it comes (steps 2 and 4, the intervals' ends, have the intervals' steps 1 and 3, and
    # their own losses as skipped_loss)
    run_ranks(1, poisoned_run, base + ["train.iters=6", "logging.log_interval=2", f"output_dir={tmp_path / 'pairs'}"],
              [2, 4], str(report))
    pairs = read_metrics(tmp_path / "pairs")
    assert [r["iteration"] for r in pairs] == [2, 4, 6]
    assert [r["lm_loss"] for r in pairs] == pytest.approx(
        [records[0]["lm_loss"], records[2]["lm_loss"], (records[4]["lm_loss"] + records[5]["lm_loss"]) / 2])
    assert math.isnan(pairs[0]["skipped_loss"]) and math.isnan(pairs[1]["skipped_loss"])
    assert "skipped_loss" not in pairs[2]

    # a background save of iteration 2, still being written, is committed before the run stops
    run_ranks(1, poisoned_run, base + ["train.iters=20", "train.max_skipped_nan_iters=2", "checkpoint.save_interval=2",
                                       "checkpoint.async_save=true", f"output_dir={tmp_path / 'stops'}",
                                       "logging.wandb_project=megadiff-tests"],
              list(range(3, 21)), str(report))
    result = json.loads(report.read_text())
    assert result["exit_code"] == 3
    assert exit_codes(sorted((tmp_path / "stops" / "wandb").glob("offline-run-*"))) == [1]  # W&B says: failed
    assert [e["iteration"] for e in result["events"]] == [1, 2, 3, 4, 5]  # stopped at the third skip
    assert read_latest_iteration(tmp_path / "stops" / CHECKPOINTS_DIR) == 4


def test_keep_last_keeps_the_last_checkpoint_before_a_streak_of_skipped_steps(base, tmp_path):
    """Every step NaN from the 4th (an lr blown up), a checkpoint at every step, keep_last=2: the saves of the
    skipped steps, which hold the 3rd step's weights again, rotated every checkpoint before the streak away.
    The last one before it is kept, and a rerun from it trains as a run never poisoned."""
    out, report, first_poisoned = tmp_path / "blown", tmp_path / "report.json", 4
    run = base + ["train.iters=8", "checkpoint.save_interval=1", "checkpoint.keep_last=2", "checkpoint.async_save=true"]
    run_ranks(1, poisoned_run, run + ["train.max_skipped_nan_iters=3", f"output_dir={out}"],
              list(range(first_poisoned, 9)), str(report))
    events = json.loads(report.read_text())["events"]
    stopped = events[-1]["iteration"]  # the step that stops the run saves nothing
    saved = list(range(1, stopped))
    before_streak = max(i for i in saved if i < first_poisoned)
    checkpoints = out / CHECKPOINTS_DIR
    assert saved_iterations(checkpoints) == sorted({*saved[-2:], before_streak})
    assert read_latest_iteration(checkpoints) == saved[-1]
    # going back: the marker moved to the checkpoint before the streak, the rerun unpoisoned
    (checkpoints / LATEST_FILE).write_text(f"{before_streak}\n")
    run_pretrain_in_ranks(1, run + [f"output_dir={out}"])
    reference = tmp_path / "reference"
    run_pretrain_in_ranks(1, run + [f"output_dir={reference}"])
    assert losses(out) == losses(reference)


def test_a_step_skipped_for_its_gradients_records_their_norm(base, tmp_path):
    """Gradients whose norm overflows fp32 while the loss stays finite: the skipped step's record held a
    finite lm_loss and no grad_norm at all, hiding what was not finite. It holds the norm the step took,
    written null as every non-finite value is; the updating steps' norms are finite."""
    output = tmp_path / "gradients"
    run_ranks(1, poisoned_run, base + ["train.iters=3", f"output_dir={output}"], [2], str(tmp_path / "report.json"),
              1e30, True)
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_iterations"] for r in lines] == [0, 1, 1] and math.isfinite(lines[1]["lm_loss"])
    assert lines[1]["grad_norm"] is None and all(lines[i]["grad_norm"] > 0 for i in (0, 2))


def test_a_stop_for_non_finite_steps_names_the_layers_whose_lambda_overflowed(base, tmp_path):
    """lambda vectors drawn far too large (model.lambda_std=10): exp(lq . lk) overflows fp32 in some layer
    and every step is NaN from the first. The stop named a non-finite loss and advised a lower train.lr;
    it names the layers whose lambda was not finite, those the metrics record as null."""
    output = tmp_path / "lambdas"
    stopped = run_pretrain_in_ranks(1, base + ["model.lambda_std=10", "train.iters=3", "train.max_skipped_nan_iters=0",
                                               f"output_dir={output}"], expect=3)
    lambdas = read_metrics(output)[-1]["lambda"]
    overflowed = [layer for layer, value in lambdas.items() if not math.isfinite(value)]
    assert overflowed and len(overflowed) < len(lambdas)  # the message must tell them apart
    said = stopped.stdout + stopped.stderr
    assert f"the lambda of {', '.join(overflowed)} is not finite" in said, said[-2000:]


def test_a_non_finite_loss_names_the_ranks_it_came_from(base, tmp_path):
    """Two data-parallel ranks (the distributed optimizer, two micro-batches each), the second one's losses
    NaN (its data, its device): every rank holds the NaN mean, and nothing said whose it was. Each skipped
    step, and the stop, name the rank and its host; both ranks stop at the same step."""
    report = tmp_path / "report"
    run_ranks(2, poisoned_on_the_last_rank, base + ["train.iters=6", "train.max_skipped_nan_iters=1",
                                                    "parallel.distributed_optimizer=true", "train.global_batch_size=8",
                                                    f"output_dir={tmp_path / 'run'}"], [2, 3], str(report))
    host = socket.gethostname()
    first, second = (report.with_name(f"report.{rank}").read_text() for rank in range(2))
    assert f"iteration 2: skipped, the loss not finite on rank 1 ({host})" in first, first[-2000:]
    stop = "iteration 3: 2 steps skipped for a non-finite loss or gradient"
    assert f"last loss nan (not finite on rank 1 ({host}))" in first and stop in first and stop in second
    assert "rank 0 (" not in first


def test_fp16_overflows_lower_the_loss_scale_until_the_run_trains(base, tmp_path):
    """fp16 starts at a loss scale of 2^32: its first steps overflow, and the scaler skips them and
    halves the scale until the gradients fit. Those are no NaN steps: the run neither stops at
    train.max_skipped_nan_iters (10) nor stays at its first weights."""
    output = tmp_path / "fp16"
    run_pretrain_in_ranks(1, base + ["train.precision=fp16", "train.iters=30", f"output_dir={output}"])
    records = read_metrics(output)
    assert records[0]["loss_scale"] == 2.0 ** 32 and records[0]["loss_scale_overflows"] == 1
    assert 10 < records[-1]["loss_scale_overflows"] < 30 and all(r["skipped_iterations"] == 0 for r in records)
    first_update = next(r for r in records if "grad_norm" in r)
    assert first_update["loss_scale"] <= 2.0 ** 22  # halved at each overflow (after megatron's hysteresis of 2)
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 0.3


@pytest.mark.slow
def test_fp16_overflows_at_the_lowest_loss_scale_are_non_finite_steps(base, tmp_path):
    """Gradients that overflow whatever the scale (the loss stays finite): the scaler halves its scale
    from 2^32 down to its floor (1), one skipped step each after megatron's hysteresis; there it can
    lower nothing, and the steps count as non-finite ones until train.max_skipped_nan_iters stops the
    run with the weights never changed."""
    report = tmp_path / "report.json"
    run_ranks(1, poisoned_run, base + ["train.precision=fp16", "train.iters=60", "train.max_skipped_nan_iters=2",
                                       f"output_dir={tmp_path / 'fp16'}"],
              list(range(1, 61)), str(report), 1e30, True)
    result = json.loads(report.read_text())
    assert result["exit_code"] == 3
    assert not any(event["updated"] or event["params_changed"] for event in result["events"])
    records = read_metrics(tmp_path / "fp16")
    floor = next(i for i, r in enumerate(records) if r["loss_scale"] == 1.0)
    assert records[floor - 1]["loss_scale"] == 2.0 and all(math.isfinite(r["lm_loss"]) for r in records)
    # the step that brought the scale to 1 was the scaler's; the next three are not, the third stops the run
    assert [r["skipped_iterations"] for r in records[floor:]] == [0, 1, 2, 3]
    assert records[-1]["loss_scale_overflows"] == floor + 1 == 33  # 2^32 -> 1: 32 halvings, + 1 for hysteresis


@pytest.mark.slow
def test_loss_spikes_are_skipped_counted_and_the_guard_resumes(base, tmp_path):
    run = base + ["train.skip_spike_sigma=6", "train.spike_window=4", "train.iters=10"]
    report = tmp_path / "report.json"
    run_ranks(1, poisoned_run, run + [f"output_dir={tmp_path / 'whole'}"], [8], str(report), 30.0)
    whole = json.loads(report.read_text())
    assert whole["exit_code"] == 0
    for event in whole["events"]:  # only the 30x step: neither the first (window filling) nor those after it
        spiked = event["iteration"] == 8
        assert event["spike"] is spiked and event["updated"] is not spiked, event
        assert event["params_changed"] is not spiked, event
    records = read_metrics(tmp_path / "whole")
    assert [r["skipped_spikes"] for r in records] == [0] * 7 + [1] * 3
    assert all(r["skipped_iterations"] == 0 for r in records)  # NaN skips are counted apart

    # stopped at 6 and rerun: the guard's window comes back with the checkpoint, so the rerun's
    # second step (iteration 8) spikes the same way and the whole loss curve is the same
    parted = tmp_path / "parted"
    run_ranks(1, poisoned_run, run + [f"output_dir={parted}", "train.exit_interval=6"], [], str(report))
    run_ranks(1, poisoned_run, run + [f"output_dir={parted}"], [2], str(report), 30.0)
    assert [event["spike"] for event in json.loads(report.read_text())["events"]] == [False, True, False, False]
    assert losses(parted) == losses(tmp_path / "whole")


@pytest.mark.slow
def test_data_parallel_ranks_agree_on_a_spike(base, tmp_path):
    """DP=2 with the distributed optimizer: each rank holds half of the gradient norm's terms, and
    an update's parameter all-gather needs every rank (one rank deciding alone would hang the run)."""
    report = tmp_path / "report.json"
    run_ranks(2, poisoned_run, base + ["train.skip_spike_sigma=6", "train.spike_window=4", "train.iters=6",
                                       "parallel.distributed_optimizer=true", f"output_dir={tmp_path / 'dp2'}"],
              [6], str(report), 30.0, timeout=180)
    result = json.loads(report.read_text())
    assert result["exit_code"] == 0
    assert [event["spike"] for event in result["events"]] == [False] * 5 + [True]


@pytest.mark.parametrize("ranks,async_save", [(1, "false"), (2, "true")])
def test_a_full_disk_while_saving_is_reported_with_the_checkpoint_kept(base, tmp_path, ranks, async_save):
    """Every write of iteration 4's checkpoint fails as on a full disk, in megatron's writer processes: the
    run ended with their "Worker failure" traceback on every rank, the partial files left taking space."""
    out, report = tmp_path / "full", tmp_path / "report.json"
    run_ranks(ranks, disk_full_while_saving, base + ["train.iters=6", "checkpoint.save_interval=2",
                                                     f"checkpoint.async_save={async_save}", f"output_dir={out}"],
              4, str(report))
    result = json.loads(report.read_text())
    assert result["exit_code"] == 3 and "Traceback" not in result["stderr"], result["stderr"]
    checkpoints = out / CHECKPOINTS_DIR
    said = (rf"the checkpoint of iteration 4 could not be written into {re.escape(str(checkpoints))} \(\[Errno 28\] "
            rf"No space left on device, on rank [01]\); the run's last checkpoint, "
            rf"{re.escape(str(checkpoints / 'iter_0000002'))}, is kept")
    assert re.search(said, result["stderr"]), result["stderr"]
    assert read_latest_iteration(checkpoints) == 2 and sorted(p.name for p in checkpoints.iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_commit_refused_on_rank_zero_stops_every_rank_and_the_rerun_resumes(base, tmp_path, async_save):
    """Rank 0 alone writes a checkpoint's marker: where the disk refused it, rank 0 stopped with its message and
    rank 1, waiting for it in a collective, failed with a traceback of its own (gloo: the peer gone; NCCL: at the
    collective timeout); the checkpoint renamed into place without its marker stayed, taking space."""
    out, report = tmp_path / "full", tmp_path / "report.json"
    run = base + ["train.iters=6", "checkpoint.save_interval=2", f"checkpoint.async_save={async_save}",
                  f"output_dir={out}"]
    run_ranks(2, marker_refused_while_committing, run, 4, str(report))
    checkpoints = out / CHECKPOINTS_DIR
    for rank_report in (report, tmp_path / "report.json.rank1"):
        result = json.loads(rank_report.read_text())
        assert result["exit_code"] == 3 and "Traceback" not in result["stderr"], result["stderr"]
        assert f"No space left on device: '{checkpoints / LATEST_FILE}'" in result["stderr"], result["stderr"]
        assert f"{checkpoints / 'iter_0000002'}, is kept" in result["stderr"], result["stderr"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_0000002", LATEST_FILE]
    run_pretrain_in_ranks(2, run)
    assert read_latest_iteration(checkpoints) == 6 and len(read_metrics(out)) == 6


@pytest.mark.slow
def test_kill_during_save_leaves_the_previous_checkpoint_usable(base, tmp_path):
    out = tmp_path / "crashed"
    run = base + ["train.iters=4", "checkpoint.save_interval=2"]
    with pytest.raises(RuntimeError, match="exit codes"):
        run_ranks(1, killed_while_saving, run + [f"output_dir={out}"], 4)
    checkpoints = out / CHECKPOINTS_DIR
    assert read_latest_iteration(checkpoints) == 2
    assert (checkpoints / "iter_0000004.partial" / "half_written.distcp").exists()
    assert not (checkpoints / "iter_0000004").exists()
    rerun = run_pretrain_in_ranks(1, run + [f"output_dir={out}"])
    assert f"resumed from {checkpoints / 'iter_0000002'}" in rerun.stdout
    assert not list(checkpoints.glob("*.partial"))
    reference = tmp_path / "reference"
    run_pretrain_in_ranks(1, run + [f"output_dir={reference}"])
    assert losses(out) == losses(reference)
