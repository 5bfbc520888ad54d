"""Progress of long commands as their logs get it without a terminal (Slurm writes standard error to a file)."""
from __future__ import annotations

import io

import pytest

from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn

from megadiff import console as console_module
from megadiff.console import progress_bars
from megadiff.inference.progress import ProgressTask, command_progress

SECONDS_PER_ITEM, ITEMS, EVERY = 10.0, 12, 30.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def as_duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def test_a_file_gets_a_line_every_interval_with_the_count_and_the_eta_of_the_pace(monkeypatch, capsys):
    """needles, evaluate, icl and lm-eval under Slurm: rich draws bars on terminals only, and to a file printed
    nothing until the work was done."""
    monkeypatch.setattr(console_module, "PROGRESS_LINE_SECONDS", EVERY)
    progress = command_progress("needles")
    progress.get_time = clock = Clock()
    seen_while_running = []
    with progress:
        task = progress.add_task("grid", total=ITEMS, rate="")
        for _ in range(ITEMS):
            clock.now += SECONDS_PER_ITEM
            progress.advance(task)
            seen_while_running.append(capsys.readouterr().err)
    printed = "".join(seen_while_running) + capsys.readouterr().err
    per_line = int(EVERY / SECONDS_PER_ITEM)
    done = range(per_line, ITEMS + 1, per_line)
    assert printed.splitlines() == [f"needles grid {n}/{ITEMS} eta {as_duration((ITEMS - n) * SECONDS_PER_ITEM)}"
                                    for n in done]
    assert seen_while_running[per_line - 1].splitlines() == printed.splitlines()[:1]  # as it went, not at the end
    assert "\x1b" not in printed and "\r" not in printed


def test_a_task_ending_between_lines_says_so_once(monkeypatch):
    monkeypatch.setattr(console_module, "PROGRESS_LINE_SECONDS", EVERY)
    log = io.StringIO()
    progress = progress_bars(TextColumn("{task.description}"), MofNCompleteColumn(), console=Console(file=log))
    progress.get_time = clock = Clock()
    with progress:
        task = progress.add_task("short", total=2)
        for _ in range(2):
            clock.now += 1
            progress.advance(task)
        progress.update(task, description="short")  # an update after the end prints nothing more
    assert log.getvalue().splitlines() == ["short 2/2"]


@pytest.mark.parametrize("prefix", ["data/E[v2]/text", "data/F[/v2]/text"])
def test_a_data_prefix_holding_brackets_is_shown_as_written(capsys, prefix):
    """evaluate's bars name the data prefix: rich read it as markup."""
    with command_progress("evaluate") as progress:
        ProgressTask(progress, prefix, 1).advance(1, tokens=10)
    assert capsys.readouterr().err.startswith(f"evaluate {prefix} 1/1 ")
