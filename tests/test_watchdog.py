"""A rank stuck outside a collective writes its stack before its peers' collective timeout fires."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from megadiff.watchdog import StallWatchdog

ROOT = Path(__file__).resolve().parents[1]


def test_a_step_that_outlasts_most_of_the_timeout_writes_the_ranks_stacks_to_its_own_file(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from megadiff.watchdog import StallWatchdog

        def stuck_reading_data():
            time.sleep(3.0)

        stalls = StallWatchdog(timeout_minutes=1 / 60, directory={str(tmp_path / "stalls")!r}, rank=3)
        quiet = StallWatchdog(timeout_minutes=2 / 60, directory={str(tmp_path / "quiet")!r}, rank=0)
        with quiet:  # a step well within its 1.8 s
            time.sleep(0.1)
        time.sleep(2.5)  # after the step: nothing is dumped
        quiet.close()
        with stalls:
            stuck_reading_data()
        stalls.close()
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    stacks = (tmp_path / "stalls" / f"rank3-{socket.gethostname()}.txt").read_text()
    assert stacks.startswith("Timeout (0:00:00.900000)!") and "in stuck_reading_data" in stacks
    assert stacks.count("Timeout (") == 1  # one dump a stall (3 s stuck): not one every 0.9 s, filling the file
    assert not (tmp_path / "quiet").exists()  # a file left empty is removed, and then its directory


def test_entering_the_watchdog_every_step_reuses_its_one_open_file(tmp_path):
    # entered around every training step: a file opened per step would leak a descriptor a step (or, if
    # collected, truncate what an earlier dump wrote), so the first step's file serves the whole run
    watchdog = StallWatchdog(timeout_minutes=60, directory=tmp_path / "stalls", rank=0)
    with watchdog:
        first = watchdog.file
    for _ in range(50):
        with watchdog:
            assert watchdog.file is first
    assert not first.closed
    watchdog.close()
    assert first.closed and not (tmp_path / "stalls").exists()
