"""The console megadiff's commands print to."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID
from rich.text import Text

# What the running command does once the reader of its standard output went away (`megadiff needles ... | head`),
# which the CLI sets for each command: a training run goes on, logging to its files, and says so (the default,
# also for in-process callers); a command writing a report file finishes it (the hours of work it holds), printing
# nothing more; any other ends there, as other Unix tools do. Either then exits with SIGPIPE's code.
GOES_ON, FINISHES, ENDS = "goes on", "finishes", "ends"
_reader_gone = {"command": GOES_ON, "went": False}


class OutputReaderGone(BrokenPipeError):
    """Standard output's reader went away, and the command printing to it ends (the CLI exits 141 quietly)."""


@contextlib.contextmanager
def when_the_reader_goes(command: str) -> Iterator[None]:
    """While the CLI runs a command: what it does once its reader went away (GOES_ON, FINISHES or ENDS)."""
    _reader_gone.update(command=command, went=False)
    try:
        yield
    finally:
        _reader_gone.update(command=GOES_ON, went=False)


def output_reader_went_away() -> bool:
    """Whether a command that FINISHES (or ENDS, on one of several ranks) lost the reader of its output."""
    return _reader_gone["went"]


def silence_standard_output(file=None) -> None:
    """Point standard output (or `file`) at /dev/null: the interpreter's last flush, failing again, would print
    a traceback of its own (the Python docs' note on SIGPIPE)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), (file or sys.stdout).fileno())


def _one_of_several_ranks() -> bool:
    """Under torchrun or srun (WORLD_SIZE is set before any process group forms)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class _PlainConsole(Console):
    def on_broken_pipe(self) -> None:
        """Its reader went away: nothing more is printed, and the command goes on, finishes or ends (see
        _reader_gone), not as rich's own ending (exit code 1, mid-run, nothing said). One rank ending alone would
        leave the others waiting for it in their next collective: it finishes instead."""
        silence_standard_output(self.file)
        self.quiet = True
        if _reader_gone["command"] == GOES_ON:
            _say_going_on()
            return
        _reader_gone["went"] = True
        if _reader_gone["command"] == ENDS and not _one_of_several_ranks():
            raise OutputReaderGone


def _say_going_on() -> None:
    try:
        print("megadiff: its output's reader went away: going on without printing", file=sys.stderr, flush=True)
    except OSError:  # standard error gone as well
        pass


@contextlib.contextmanager
def timed_step(console: Console, action: str) -> Iterator[None]:
    """'ACTION ...' now, 'ACTION: N s' once it is done: work of minutes that prints nothing looks like a hang,
    and a job killed meanwhile leaves its log saying what it was doing."""
    console.print(f"{action} ...")
    started = time.perf_counter()
    yield
    console.print(f"{action}: {time.perf_counter() - started:.1f} s")


def plain_console(**options) -> Console:
    """rich's console printing text as written: with markup, a path or name holding brackets was cut
    (output_dir runs/E[v1] printed as runs/E) or raised a MarkupError (runs/F[/v1], at a run's start)."""
    return _PlainConsole(soft_wrap=True, markup=False, highlight=False, **options)


# How often a progress line goes to a file or pipe (a Slurm log): often enough to show a job is alive, seldom enough
# that a day's run logs a few thousand lines
PROGRESS_LINE_SECONDS = 30.0


def progress_bars(*columns, console: Console, disable: bool = False) -> Progress:
    """rich's bars on a terminal; elsewhere (a Slurm log, a pipe) a plain line per task now and then: rich draws
    its bars on terminals only, and printed nothing to a file until all the work was done (a job hours in was
    silent), then the bars' characters."""
    if console.is_terminal and not console.is_dumb_terminal:
        return Progress(*columns, console=console, disable=disable)
    return LoggedProgress(*columns, every=PROGRESS_LINE_SECONDS, console=console, disable=disable)


class LoggedProgress(Progress):
    """Progress as lines of text: a task's columns but its bar, every `every` seconds and once when it ends."""

    def __init__(self, *columns, every: float, **options):
        # a window of several lines: items taking longer than rich's 30 s window left it no two samples, and the
        # ETA unknown
        super().__init__(*columns, speed_estimate_period=10 * every, **options)
        self.every = every
        self._printed: dict[TaskID, tuple[float, float]] = {}  # task: when its last line was, and its count then

    def start(self) -> None:
        """No live display: to a file, rich's would only print the bars, and a blank line, once done."""

    def stop(self) -> None:
        pass

    def update(self, task_id: TaskID, **changes) -> None:
        super().update(task_id, **changes)
        self._print_when_due(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._print_when_due(task_id)

    def _print_when_due(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        if self.disable or not task.visible:
            return
        now = self.get_time()
        last_time, last_completed = self._printed.get(task_id, (task.start_time or now, 0.0))
        due = task.completed != last_completed if task.finished else now - last_time >= self.every
        if due:
            # as written and on one line: a log's console is 80 columns wide
            self.console.print(self.progress_line(task_id), markup=False, highlight=False, soft_wrap=True)
            self._printed[task_id] = (now, task.completed)

    def progress_line(self, task_id: TaskID) -> str:
        task = self._tasks[task_id]
        shown = (column.render(task) for column in self.columns if not isinstance(column, BarColumn))
        words = " ".join(text.plain if isinstance(text, Text) else str(text) for text in shown)
        return " ".join(words.split())  # without the padding that aligns a terminal's columns
