"""Weights & Biases: asking for it without wandb installed is a config error. Runs that log to it
are read back from W&B's offline transaction log (tests/wandb_log.py) in the resume test
(tests/test_pretrain_resume.py: one W&B run across a stop) and the ZeRO-2 adapt run."""
from __future__ import annotations

import importlib.util
import os

import pytest

from megadiff.config import ConfigError, build_config


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match="logging.wandb_project: .*pip install wandb"):
        build_config({}, ["logging.wandb_project=x"])


ENDS_WITHOUT_EXIT_HANDLERS = """
import os, sys
from pathlib import Path
import psutil
from megadiff.observability.wandb_sink import WandbSink
sink = WandbSink(Path(sys.argv[1]), "project", None, None, {"seed": 1})
sink.log({"iteration": 1, "lm_loss": 2.5})
sink.close(failed=sys.argv[2] == "failed")
print(len(psutil.Process().children(recursive=True)), flush=True)
os._exit(0)  # as `megadiff adapt` and multiprocessing's ranks end: no atexit handler runs
"""


@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_a_closed_run_is_written_before_a_process_ends_without_exit_handlers(tmp_path, ending):
    """wandb-core wrote a run's last records (its exit record among them) as its service shut down, at
    interpreter exit: a process ending with os._exit left that to chance. Closing now waits for the service."""
    import subprocess
    import sys

    from tests.wandb_log import exit_codes

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = subprocess.run([sys.executable, "-c", ENDS_WITHOUT_EXIT_HANDLERS, str(tmp_path), ending], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["0"]  # W&B's service had ended when close() returned
    assert exit_codes(sorted((tmp_path / "wandb").glob("offline-run-*"))) == [0 if ending == "finished" else 1]
