"""A rank stuck outside a collective prints its stack before its peers' collective timeout fires."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_iteration_that_outlasts_most_of_the_timeout_dumps_the_stacks_once():
    script = textwrap.dedent("""
        import time
        from megadiff.watchdog import StallWatchdog

        def stuck_reading_data():
            time.sleep(2.0)

        watchdog = StallWatchdog(timeout_minutes=1 / 60)  # dumps 0.9 s into an iteration
        watchdog.arm()
        time.sleep(0.5)
        watchdog.arm()  # a new iteration: the timer starts again
        stuck_reading_data()
        watchdog.disarm()
        time.sleep(1.0)  # disarmed: no second dump
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("Timeout (0:00:00.900000)!") == 1, run.stderr
    assert "in stuck_reading_data" in run.stderr
