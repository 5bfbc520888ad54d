"""A torch.profiler window over chosen training iterations, on chosen ranks.

`logging.profile_iterations: [first, last]` records iterations first..last (1-based, as logged)
on each rank of `logging.profile_ranks` and writes, per rank, into <output_dir>/profile/:
- trace-rank<r>-iters<first>-<last>.json: the Chrome/Perfetto trace (chrome://tracing,
  ui.perfetto.dev), CPU ops and, on GPUs, CUDA kernels (the fused attention kernel included),
  each iteration a "megadiff iteration N" span;
- ops-rank<r>-iters<first>-<last>.txt: the ops sorted by their own device (else CPU) time;
- with `logging.profile_memory` on CUDA, memory-rank<r>-iters<first>-<last>.pickle: a CUDA memory
  snapshot of the window for pytorch.org/memory_viz.
A run resumed after `first` records nothing (the window has passed).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILE_DIR = "profile"
ITERATION_MARKER = "megadiff iteration"
# what the CUDA memory snapshot keeps: enough allocation events for a few large iterations
MEMORY_HISTORY_ENTRIES = 1_000_000


class IterationProfiler:
    def __init__(self, output_dir: str | Path, rank: int, iterations: tuple[int, int] | None,
                 ranks: list[int], memory: bool = False):
        self.window = iterations if iterations is not None and rank in ranks else None
        self.directory = Path(output_dir) / PROFILE_DIR
        self.rank = rank
        self.cuda = torch.cuda.is_available()
        self.memory = memory and self.cuda
        self._profile: profile | None = None
        self._marker: record_function | None = None

    def _name(self, kind: str, suffix: str) -> Path:
        first, last = self.window
        return self.directory / f"{kind}-rank{self.rank}-iters{first}-{last}.{suffix}"

    def start(self, iteration: int) -> None:
        """Call before running `iteration`: opens the window at its first iteration, and marks each
        iteration in it ("megadiff iteration N" spans the whole step in the trace)."""
        if self.window is not None and iteration == self.window[0]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profile = profile(activities=activities, record_shapes=True)
            self._profile.__enter__()
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        if self._profile is not None:
            self._marker = record_function(f"{ITERATION_MARKER} {iteration}")
            self._marker.__enter__()

    def stop(self, iteration: int, final: bool = False) -> list[Path]:
        """Call after `iteration` ran, and with `final` when the loop ends (a stop inside the window
        still writes what was recorded); returns the files written."""
        self._end_marker()
        if self._profile is None or (iteration < self.window[1] and not final):
            return []
        self._profile.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        written = [self._name("trace", "json"), self._name("ops", "txt")]
        self._profile.export_chrome_trace(str(written[0]))
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        written[1].write_text(self._profile.key_averages().table(sort_by=sort_by, row_limit=60))
        if self.memory:
            written.append(self._name("memory", "pickle"))
            torch.cuda.memory._dump_snapshot(str(written[-1]))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._profile = None
        return written

    def close(self) -> None:
        """Ends a window left open, writing nothing: a run stopped by an error inside it left torch's profiler on
        for the rest of the process (a notebook's, a sweep driver's), recording every later op in memory while
        the traceback was kept."""
        self._end_marker()
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)

    def _end_marker(self) -> None:
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
