"""The metrics writer: its console line (the remaining-time estimate, its formatting) and its files on resume."""
from __future__ import annotations

import json
import math

import pytest

from megadiff.observability.metrics import MetricsWriter, StepMeans, format_duration, read_metrics, records_at


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.6, "1m00s"), (61, "1m01s"), (3600 * 3 + 7 * 60 + 30, "3h07m"),
                                           (86400 * 2 + 3600 * 5 + 59, "2d05h")])
def test_durations_read_at_a_glance(seconds, text):
    assert format_duration(seconds) == text


def test_eta_follows_the_pace_since_the_first_logged_iteration(tmp_path):
    clock = FakeClock()
    writer = MetricsWriter(tmp_path, resume_from_iteration=10, tensorboard=False, total_iterations=110,
                           console_keys=("lm_loss",), clock=clock)
    lines = []
    for iteration, seconds_taken in ((11, 500.0), (12, 2.0), (13, 4.0), (13, 1.0)):
        clock.now += seconds_taken  # the first iteration after a resume also pays for start-up
        lines.append(writer.progress_line({"iteration": iteration, "lm_loss": 2.0}))
    writer.close()
    assert lines[0] == "iteration 11/110 | lm_loss 2.0000"  # no pace known yet
    # 2 s for one iteration, 98 left
    assert lines[1] == f"iteration 12/110 | lm_loss 2.0000 | eta {format_duration(2.0 * 98)}"
    assert lines[2].endswith(f"eta {format_duration((2.0 + 4.0) / 2 * 97)}")
    # a second record of the same iteration (validation) uses the time of now
    assert lines[3].endswith(f"eta {format_duration((2.0 + 4.0 + 1.0) / 2 * 97)}")


def test_resumed_run_drops_the_iterations_it_runs_again(tmp_path):
    first = MetricsWriter(tmp_path, tensorboard=False)
    for iteration in (1, 2, 3, 4):
        first.log({"iteration": iteration, "lm_loss": float(iteration)})
    first.close()
    resumed = MetricsWriter(tmp_path, resume_from_iteration=2, tensorboard=False)
    resumed.log({"iteration": 3, "lm_loss": 30.0})
    resumed.close()
    assert [(r["iteration"], r["lm_loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_run_killed_while_dropping_the_iterations_it_runs_again_keeps_its_history(tmp_path, monkeypatch):
    first = MetricsWriter(tmp_path, tensorboard=False)
    for iteration in (1, 2, 3):
        first.log({"iteration": iteration, "lm_loss": float(iteration)})
    first.close()
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def killed(*args):
        raise KeyboardInterrupt  # stands for the process dying before the new file replaces the old

    monkeypatch.setattr("megadiff.files.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsWriter(tmp_path, resume_from_iteration=1, tensorboard=False)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_a_last_line_cut_short_is_left_out_and_the_run_resumes(tmp_path):
    """A crash or a full disk while a line was written: the iteration it records is run again on resume."""
    first = MetricsWriter(tmp_path, tensorboard=False)
    for iteration in (1, 2):
        first.log({"iteration": iteration, "lm_loss": float(iteration)})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write('{"iteration": 3, "lm_lo')
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2]
    resumed = MetricsWriter(tmp_path, resume_from_iteration=2, tensorboard=False)
    resumed.log({"iteration": 3, "lm_loss": 3.0})
    resumed.close()
    assert [(r["iteration"], r["lm_loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0)]



def test_damaged_lines_are_left_out_and_said_and_the_run_resumes(tmp_path, capsys):
    """A line cut short in the middle, or bytes that are no UTF-8 (not a crash's: a damaged or edited file):
    the resume stopped with a traceback, where the checkpoint it resumes holds all the training needs."""
    first = MetricsWriter(tmp_path, tensorboard=False)
    for iteration in (1, 2, 3):
        first.log({"iteration": iteration, "lm_loss": float(iteration)})
    first.close()
    lines = (tmp_path / "metrics.jsonl").read_bytes().split(b"\n")
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join([lines[0][:10], lines[1], b"\xff\xfe", lines[2], b""]))
    capsys.readouterr()
    resumed = MetricsWriter(tmp_path, resume_from_iteration=2, tensorboard=False)
    assert f"{tmp_path / 'metrics.jsonl'}: lines [1, 3] are no JSON records (a damaged file?): left out" in \
        capsys.readouterr().err.replace("\n", "")
    resumed.log({"iteration": 3, "lm_loss": 3.5})
    resumed.close()
    assert [(r["iteration"], r["lm_loss"]) for r in read_metrics(tmp_path)] == [(2, 2.0), (3, 3.5)]
    assert not capsys.readouterr().err


def test_non_finite_values_are_written_as_strict_json_and_read_back_as_nan(tmp_path):
    """A diverged step's NaN loss or an overflowed grad_norm: jq, pandas or a browser read the file."""
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log({"iteration": 1, "lm_loss": math.nan, "grad_norm": math.inf, "lambda": {"layer_1": -math.inf}})
    writer.log({"iteration": 2, "lm_loss": 2.0, "grad_norm": 1.0, "lambda": {"layer_1": 0.5}})
    writer.close()
    strict = [json.loads(line, parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}"))
              for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert strict[0] == {"iteration": 1, "lm_loss": None, "grad_norm": None, "lambda": {"layer_1": None}}
    first, second = read_metrics(tmp_path)
    assert math.isnan(first["lm_loss"]) and math.isnan(first["grad_norm"]) and math.isnan(first["lambda"]["layer_1"])
    assert second == {"iteration": 2, "lm_loss": 2.0, "grad_norm": 1.0, "lambda": {"layer_1": 0.5}}


def test_a_run_restarted_from_scratch_logs_each_iteration_once_to_tensorboard(tmp_path):
    """Crashed before its first checkpoint and run again: TensorBoard drops the first run's points too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for iterations in ((1, 2, 3), (1, 2, 3, 4)):
        writer = MetricsWriter(tmp_path, tensorboard=True)
        for iteration in iterations:
            writer.log({"iteration": iteration, "lm_loss": float(iteration)})
        writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("lm_loss")] == [1, 2, 3, 4]


def test_a_record_every_few_steps_takes_the_means_of_the_steps_since_the_last():
    means = StepMeans()
    for loss, seconds in ((2.0, 1.0), (4.0, 3.0)):
        means.add(loss, seconds)
    assert len(means) == 2 and means.take() == (3.0, 2.0)
    assert len(means) == 0  # taken: the next record's steps start afresh
    means.add(5.0, 1.5)
    assert means.take() == (5.0, 1.5)


def test_step_means_continue_from_their_saved_state():
    """What a checkpoint keeps of the steps since the last record (through JSON, as strictly as any
    checkpoint format): the resumed means are those of every step since that record."""
    means = StepMeans()
    means.add(2.0, 1.0)
    resumed = StepMeans(json.loads(json.dumps(means.state())))
    resumed.add(4.0, 3.0)
    assert len(resumed) == 2 and resumed.take() == (3.0, 2.0)
    assert StepMeans(StepMeans().state()).state() == {"sums": [], "steps": 0}


def test_a_run_records_every_interval_and_after_its_last_iteration():
    assert [i for i in range(1, 8) if records_at(i, 3, 7)] == [3, 6, 7]
    assert [i for i in range(1, 3) if records_at(i, 10, 2)] == [2]  # a run shorter than the interval


def test_messages_and_progress_lines_print_as_written(tmp_path, capsys):
    """Paths and names are no markup: an output_dir runs/E[v1] printed as runs/E, and runs/F[/v1] raised
    a MarkupError as the run started."""
    writer = MetricsWriter(tmp_path / "E[v1]", tensorboard=False)
    message = f"metrics and checkpoints in {tmp_path / 'E[v1]'}; data.blend[0] [bold]x[/bold] F[/v1]"
    writer.print(message)
    writer.log({"iteration": 1, "lm_loss": 2.5, "note[/x]": 1.0})
    writer.close()
    out = capsys.readouterr().out
    assert message in out and "note[/x] 1" in out
