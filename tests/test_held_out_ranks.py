"""The checkpoint commands under torchrun: evaluate, needles and outliers run by two real gloo ranks
split the sequences (cases) between them, and rank 0 reports what one process reports and shows
the progress."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from megadiff.checkpoint.single_process import CausalLM
from megadiff.cli import main
from tests.distributed import run_ranks
from tests.held_out_runs import held_out_run

COMMANDS = {
    "evaluate": ["--sequences", "5", "--batch-size", "2", "--buckets", "4", "--frequent-bigrams", "2000",
                 "--bigram-sample-tokens", "5000"],  # 64 windows of the training split, shared by the ranks
    "needles": ["--lengths", "160", "256", "--depths", "0", "1", "--trials", "2", "--attention"],
    "outliers": ["--sequences", "3", "--batch-size", "2"],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return held_out_run(tmp_path_factory.mktemp("ranks"), "diff")[0]


@contextmanager
def counting_sequences(counts: dict, command: str):
    """Count the sequences that pass through the model (every command's forward goes through
    CausalLM.hidden_states) under counts[command]."""
    original = CausalLM.hidden_states

    def counted(self, input_ids, *args, **kwargs):
        counts[command] = counts.get(command, 0) + input_ids.shape[0]
        return original(self, input_ids, *args, **kwargs)

    CausalLM.hidden_states = counted
    try:
        yield
    finally:
        CausalLM.hidden_states = original


def _run_commands(rank: int, world_size: int, run_dir: str, out_dir: str) -> None:
    counts = {}
    for command, args in COMMANDS.items():
        with counting_sequences(counts, command):
            assert main([command, "--load", run_dir, *args, "--output", f"{out_dir}/{command}.json"]) == 0
    Path(out_dir, f"counts{rank}.json").write_text(json.dumps(counts))


def _assert_close(two, one, where: str = "report") -> None:
    if isinstance(one, dict):
        assert set(two) == set(one), where
        for key in one:
            _assert_close(two[key], one[key], f"{where}.{key}")
    elif isinstance(one, list):
        assert len(two) == len(one), where
        for i, (a, b) in enumerate(zip(two, one)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(one, float):
        # batches group other sequences on two ranks: the last bits of a row may differ
        assert two == pytest.approx(one, rel=1e-5, abs=1e-7), where
    else:
        assert two == one, where


def test_two_ranks_share_the_work_and_report_what_one_process_reports(run, tmp_path, capfd):
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    run_ranks(2, _run_commands, str(run), str(tmp_path / "two"))
    logs = capfd.readouterr().err
    _run_commands(0, 1, str(run), str(tmp_path / "one"))

    for command in COMMANDS:
        _assert_close(json.loads((tmp_path / "two" / f"{command}.json").read_text()),
                      json.loads((tmp_path / "one" / f"{command}.json").read_text()), command)
    one = json.loads((tmp_path / "one" / "counts0.json").read_text())
    ranks = [json.loads((tmp_path / "two" / f"counts{rank}.json").read_text()) for rank in range(2)]
    for command in COMMANDS:
        assert ranks[0][command] + ranks[1][command] == one[command], command
        assert 0 < ranks[1][command] <= ranks[0][command] < one[command], command
    # rank 0 prints the reports, rank 1 nothing of them (run_ranks leaves out a silent rank's log)
    rank0, _, rank1 = logs.partition("----- rank 1 -----")
    for title in ("valid loss", "mean accuracy", "largest |activations|"):
        assert title in rank0 and title not in rank1, title
    # and a progress bar for each command, with the rate of both ranks
    assert "needles 2 lengths x 2 depths x 2 trials" in rank0 and rank0.count("tokens/s") >= 3


def _needles(run_dir, data_dir: Path, *extra: str) -> list[str]:
    """needles on the bundled corpus, whose "up to date" line comes before the weights are read."""
    bundled = ["data.sources=[]", "data.bundled_corpus=kjv", f"data.prefix={data_dir / 'kjv'}"]
    return ["needles", "--load", str(run_dir), "--lengths", "160", "--depths", "0", "1", "--trials", "2", *extra,
            *bundled]


def _printing_to_a_pipe_without_reader(command: list[str]) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that has read what it wanted
    try:
        return subprocess.run([sys.executable, "-m", "megadiff", *command], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    finally:
        os.close(write_end)


def test_a_command_whose_reader_went_away_stops_quietly_with_sigpipe_s_code(run, tmp_path):
    """`megadiff needles ... | head`: it said so on stderr and went on computing every case, to exit 0. Now it
    stops at its first line unprinted, before any case is scored, as other Unix tools do (exit code 141)."""
    stopped = _printing_to_a_pipe_without_reader(_needles(run, tmp_path))
    assert stopped.returncode == 141, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "going on" not in stopped.stderr, stopped.stderr[-3000:]
    assert "needles 2 lengths" not in stopped.stderr  # no progress line: no case was scored


def test_a_command_whose_reader_went_away_still_writes_its_report_file(run, tmp_path):
    """With --output the hours of work are kept: the command finishes writing the file, what an uninterrupted
    run writes, then exits as a stopped one."""
    finished = _printing_to_a_pipe_without_reader(_needles(run, tmp_path, "--output", str(tmp_path / "cut.json")))
    assert finished.returncode == 141 and "Traceback" not in finished.stderr, finished.stderr[-3000:]
    assert main(_needles(run, tmp_path, "--output", str(tmp_path / "whole.json"))) == 0
    assert json.loads((tmp_path / "cut.json").read_text()) == json.loads((tmp_path / "whole.json").read_text())


def _needles_with_rank_0_s_reader_gone(rank: int, world_size: int, run_dir: str, out_dir: str) -> None:
    if rank == 0:
        read_end, write_end = os.pipe()
        os.close(read_end)
        os.dup2(write_end, sys.stdout.fileno())
    code = main(_needles(run_dir, Path(out_dir)))
    Path(out_dir, f"code{rank}").write_text(str(code))


def test_two_ranks_finish_together_when_rank_0_s_reader_went_away(run, tmp_path):
    """Rank 0 stopping alone would leave the other waiting for it in a collective (here its process group's
    forming): it finishes, printing nothing, and exits 141; rank 1 exits 0."""
    run_ranks(2, _needles_with_rank_0_s_reader_gone, str(run), str(tmp_path), timeout=300)
    assert [(tmp_path / f"code{rank}").read_text() for rank in range(2)] == ["141", "0"]
