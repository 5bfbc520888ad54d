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


def a_refused_run_then_another(rank: int, world_size: int, overrides: list[str], output: str) -> None:
    """In this process (a sweep driver's), two runs logging to W&B: the first refused after its W&B run began (its
    data has more ids than model.vocab_size), the second trained."""
    from pathlib import Path

    from megadiff.config import load_config
    from megadiff.data.errors import DataError
    from megadiff.training.pretrain import pretrain
    from tests.pretrain_runs import DEMO_CONFIG

    with pytest.raises(DataError, match="model.vocab_size"):
        pretrain(load_config(DEMO_CONFIG, overrides + [f"output_dir={Path(output) / 'refused'}",
                                                       "model.vocab_size=100"]))
    assert pretrain(load_config(DEMO_CONFIG, overrides + [f"output_dir={Path(output) / 'trained'}"])) == 0


def test_a_run_refused_after_its_w_and_b_run_began_finishes_it_as_failed(small_tokenizer_dir, tmp_path):
    """The refused run's W&B run stayed open, and W&B gave it to the next run of the process, whose curve went into
    it, finished as a success; the next run's own W&B run stayed empty."""
    from megadiff.observability.metrics import read_metrics
    from tests.distributed import run_ranks
    from tests.pretrain_runs import tiny_overrides
    from tests.wandb_log import exit_codes, logged_history_and_config

    overrides = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + ["train.iters=2",
                                                                           "logging.wandb_project=megadiff-tests"]
    run_ranks(1, a_refused_run_then_another, overrides, str(tmp_path))
    refused, trained = (sorted((tmp_path / name / "wandb").glob("offline-run-*")) for name in ("refused", "trained"))
    assert exit_codes(refused) == [1] and logged_history_and_config(refused)[0] == []
    history, config = logged_history_and_config(trained)
    assert exit_codes(trained) == [0] and config["output_dir"] == str(tmp_path / "trained")
    assert [r["lm_loss"] for r in history if "lm_loss" in r] == [
        r["lm_loss"] for r in read_metrics(tmp_path / "trained") if "lm_loss" in r]
