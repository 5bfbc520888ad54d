"""Where training metrics go: metrics.jsonl, TensorBoard scalars and a console progress line.

Shared by pre-training and adaptation, so both runs read the same way. Pure Python + torch's
TensorBoard writer (+ W&B when asked): no megatron here. Only the logging rank creates a writer.

metrics.jsonl holds one JSON object per logged iteration. Its keys are the caller's: numbers,
and dicts of numbers (e.g. {"lambda": {"layer_1": 0.2}}), which TensorBoard gets as
"lambda/layer_1". A NaN or infinite value is written as null, which strict JSON readers (jq,
pandas, JavaScript) take; `read_metrics` gives it back as NaN. A run that resumes appends, after
dropping the lines of iterations it will run again, so the file always reads as one uninterrupted run.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from megadiff.console import plain_console
from megadiff.files import write_atomically
from megadiff.observability.wandb_sink import WandbSink

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of metrics.jsonl (or of the one in directory `path`); a last line cut short (a crash or a
    full disk while it was written) is left out, as the iteration it records is run again on resume. Another
    line that is no record (the file damaged or edited) is left out too, and said: a resume or a fit goes on
    without it, where the traceback stopped it."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = [(number, line) for number, line in enumerate(
        path.read_bytes().decode("utf-8", errors="replace").split("\n"), start=1) if line.strip()]
    records, damaged = [], []
    for number, line in lines:
        try:
            records.append(_parse(line))
        except json.JSONDecodeError:
            damaged.append(number)
    if damaged and damaged != [lines[-1][0]]:
        plain_console(stderr=True).print(f"{path}: lines {[n for n in damaged if n != lines[-1][0]]} are no JSON "
                                         "records (a damaged file?): left out")
    return records


def _parse(line: str) -> dict:
    return json.loads(line, object_hook=lambda record: {k: math.nan if v is None else v for k, v in record.items()})


def _to_json(record: dict) -> str:
    """One strict JSON line: non-finite numbers as null."""
    def finite(value):
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        return None if isinstance(value, float) and not math.isfinite(value) else value
    return json.dumps(finite(record), allow_nan=False)


def _flatten(record: dict, prefix: str = "") -> dict[str, float]:
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = value
    return flat


def _format(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.3e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5) else f"{value:.4f}"
    return str(value)


def format_duration(seconds: float) -> str:
    """12s, 4m05s, 3h07m, 2d05h: two units at most, enough for a glance at a long run."""
    seconds = int(round(seconds))
    for unit, size, sub_unit, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= size:
            return f"{seconds // size}{unit}{seconds % size // sub_size:02d}{sub_unit}"
    return f"{seconds}s"


def records_at(iteration: int, log_interval: int, last_iteration: int) -> bool:
    """Whether a run records after `iteration`: every log_interval steps, and after its last iteration
    (the steps since the previous record are not left out)."""
    return iteration % log_interval == 0 or iteration == last_iteration


class StepMeans:
    """What a record made every log_interval steps reports: the means of the steps' values since the
    last record (as Megatron-LM logs), not the last step's alone.

    A checkpoint keeps `state()`: a run stopped between two records and resumed from it (`StepMeans(state)`)
    records the same means as an uninterrupted run."""

    def __init__(self, state: dict | None = None):
        self._sums: list[float] = list(state["sums"]) if state else []
        self._steps: int = state["steps"] if state else 0

    def __len__(self) -> int:
        """The steps added since the last take."""
        return self._steps

    def add(self, *values: float) -> None:
        self._sums = [total + value for total, value in zip(self._sums, values)] if self._steps else list(values)
        self._steps += 1

    def take(self) -> tuple[float, ...]:
        """The mean of each value over the steps added since the last take (at least one)."""
        means = tuple(total / self._steps for total in self._sums)
        self._sums, self._steps = [], 0
        return means

    def state(self) -> dict:
        return {"sums": list(self._sums), "steps": self._steps}


def record_step(means: StepMeans, loss: float, seconds: float, updated: bool,
                on_interval: bool) -> tuple[float, float, float | None] | None:
    """Adds a step to `means` (an updating one: a skipped step's NaN would make its interval's mean NaN) and
    gives what its record holds, (lm_loss, seconds, skipped_loss or None), or None where it makes none. A
    skipped step between records is recorded alone, as it comes; one ending an interval of updating steps
    records their means, and its own loss as skipped_loss."""
    if updated:
        means.add(loss, seconds)
    if updated and not on_interval:
        return None
    pending = on_interval and len(means) > 0
    mean_loss, mean_seconds = means.take() if pending else (loss, seconds)
    return mean_loss, mean_seconds, loss if pending and not updated else None


def streak_start(since: int | None, iteration: int, skipped: bool, updated: bool) -> int | None:
    """The first iteration of the streak of skipped steps (a non-finite loss or gradient, a spike) a run is in
    after `iteration`, given the streak's start `since` before it: an update ends the streak, a skipped step
    starts or continues it, any other step (no loss tokens, fp16's loss scaler finding its scale) leaves it."""
    if updated:
        return None
    return iteration if skipped and since is None else since


class MetricsWriter:
    """Write with `log(record)`; `record["iteration"]` is the step axis."""

    def __init__(self, run_dir: str | Path, *, resume_from_iteration: int = 0, tensorboard: bool = True,
                 total_iterations: int | None = None, console_keys: tuple[str, ...] = (),
                 clock: Callable[[], float] = time.monotonic, wandb: WandbSink | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._truncate_after(resume_from_iteration)
        self._file = open(self.path, "a")
        self.total = total_iterations
        self.console_keys = console_keys
        self._clock = clock
        self._first_logged: tuple[float, int] | None = None  # (time, iteration): the rate excludes start-up
        self.console = plain_console()
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purged from the first iteration run again: a run restarted from scratch too (crashed before its
            # first checkpoint) would otherwise show its first iterations twice
            self._tensorboard = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR),
                                              purge_step=resume_from_iteration + 1)
        self._wandb = wandb

    def _truncate_after(self, iteration: int) -> None:
        """Keep the lines of iterations <= `iteration` (the checkpoint this run resumed from)."""
        if not self.path.exists():
            return
        kept = [record for record in read_metrics(self.path) if record.get("iteration", 0) <= iteration]
        # atomically: a run killed here (preempted as it starts) keeps the whole history
        write_atomically(self.path, "".join(_to_json(record) + "\n" for record in kept).encode())

    def log(self, record: dict) -> None:
        self._file.write(_to_json(record) + "\n")
        self._file.flush()
        step = record["iteration"]
        flat = _flatten(record)
        if self._tensorboard is not None:
            for key, value in flat.items():
                if key != "iteration":
                    self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(flat)
        self.console.print(self.progress_line(record))

    def progress_line(self, record: dict) -> str:
        total = f"/{self.total}" if self.total else ""
        keys = self.console_keys or tuple(k for k, v in record.items() if k != "iteration" and not isinstance(v, dict))
        parts = [f"iteration {record['iteration']}{total}"]
        parts += [f"{key} {_format(record[key])}" for key in keys if key in record]
        eta = self._eta(record["iteration"])
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        return " | ".join(parts)

    def _eta(self, iteration: int) -> float | None:
        """Seconds left at the mean pace since the first logged iteration (which start-up delays)."""
        now = self._clock()
        if self._first_logged is None:
            self._first_logged = (now, iteration)
        start_time, start_iteration = self._first_logged
        if not self.total or iteration <= start_iteration:
            return None
        return (now - start_time) / (iteration - start_iteration) * max(self.total - iteration, 0)

    def print(self, message: str) -> None:
        self.console.print(message)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ends with an error (W&B marks it so)."""
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.close(failed)
