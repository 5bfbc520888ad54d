"""Weights & Biases: asking for it without wandb installed is a config error. Runs that log to it
are read back from W&B's offline transaction log (tests/wandb_log.py) in the resume test
(tests/test_pretrain_resume.py: one W&B run across a stop) and the ZeRO-2 adapt run."""
from __future__ import annotations

import importlib.util

import pytest

from megadiff.config import ConfigError, build_config


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match="logging.wandb_project: .*pip install wandb"):
        build_config({}, ["logging.wandb_project=x"])
