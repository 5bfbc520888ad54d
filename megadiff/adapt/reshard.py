"""A rerun of an adaptation on another number of data-parallel ranks than its checkpoint's.

ZeRO keeps the optimizer state (and ZeRO-3 the weights) partitioned among the ranks that wrote it, and DeepSpeed
loads it only into as many. Its universal checkpoint is the state of each parameter whole (fp32 weights, Adam's
moments, step), which an engine of any size loads: a rerun on a Slurm allocation of another size converts the
checkpoint it resumes from once (`universal/` inside it, made by rank 0 on the shared checkpoint directory) and
loads that.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megadiff.adapt.resume import DamagedCheckpoint, saved_dp_world_size
from megadiff import console as console_module
from megadiff.console import plain_console
from megadiff.errors import refused_together
from megadiff.files import appears

UNIVERSAL_DIR = "universal"  # inside a checkpoint: its universal form (a DeepSpeed tag of the checkpoint itself)
LAST_LINE_BYTES = 4096  # what is read back of the converter's output for its last line


def universal_form(checkpoint: Path, rank: int, world: int) -> Path | None:
    """The universal form of `checkpoint` where it was written by another number of data-parallel ranks than
    `world` (None otherwise; collective): converted by rank 0 where no earlier rerun left it, then seen by every
    rank (a node that cannot see it holds the checkpoint directory on a disk of its own)."""
    written_by = saved_dp_world_size(checkpoint)
    if written_by is None or written_by == world:
        return None
    universal = checkpoint / UNIVERSAL_DIR
    refused_together(lambda: _convert(checkpoint, universal, written_by, world) if rank == 0 else None)

    def seen_here() -> None:
        if not appears(universal / "zero", directory=True):  # renamed into place on another node, maybe a moment ago
            raise DamagedCheckpoint(f"{universal} (made by rank 0) is not seen here: a rerun on another number of "
                                    "ranks needs the checkpoint directory shared by every node")
    refused_together(seen_here)
    return universal


def _convert(checkpoint: Path, universal: Path, written_by: int, world: int) -> None:
    if (universal / "zero").is_dir():
        return
    console = plain_console()
    console.print(f"{checkpoint.name} was written by {written_by} data-parallel rank(s) and this run has "
                  f"{world}: converting it to DeepSpeed's universal checkpoint, {universal}")
    partial = checkpoint / f"{UNIVERSAL_DIR}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # an earlier conversion that did not end
    # its own process: the converter prints as it goes, and forks workers (not under this one's process group);
    # the files it reads were checked to hold DeepSpeed's types alone (resume_point)
    started = time.monotonic()
    code, said = _run_saying_how_far(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
         "--output_folder", str(partial), "--num_extract_workers", "1", "--num_merge_workers", "1",
         # the universal_checkpoint_info Megatron-DeepSpeed's models record (TP and PP merge patterns): a Hugging
         # Face model has neither, and the converter refuses its checkpoint without it
         "--inject_missing_state"], f"{checkpoint.name}: converting", console)
    if code != 0:
        raise DamagedCheckpoint(f"{checkpoint} could not be converted for {world} rank(s) (DeepSpeed's "
                                f"ds_to_universal: {said or 'no output'}): rerun on {written_by} rank(s)")
    os.replace(partial, universal)  # whole or absent
    console.print(f"{checkpoint.name}: converted in {time.monotonic() - started:.0f} s")


def _run_saying_how_far(command: list[str], doing: str, console) -> tuple[int, str]:
    """Runs `command`, printing its last line of output every PROGRESS_LINE_SECONDS (a 13B model's state takes
    the converter many minutes, which printed nothing: its output was kept for an error message); its exit code
    and last line."""
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            while True:
                try:
                    code = process.wait(timeout=console_module.PROGRESS_LINE_SECONDS)
                    return code, _last_line(output)
                except subprocess.TimeoutExpired:
                    console.print(f"{doing}: {_last_line(output)}")
        except BaseException:  # interrupted: the converter stops too
            process.kill()
            process.wait()
            raise


def _last_line(output) -> str:
    """The last line written to `output`, where a progress bar's updates (tqdm's, to a file) are lines ending in
    carriage returns, not newlines."""
    tail = os.pread(output.fileno(), LAST_LINE_BYTES, max(os.fstat(output.fileno()).st_size - LAST_LINE_BYTES, 0))
    lines = [line.strip() for line in tail.decode(errors="replace").replace("\r", "\n").splitlines()]
    return next((line for line in reversed(lines) if line), "")
