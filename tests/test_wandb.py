"""Weights & Biases logging, read back from W&B's own offline transaction log: a pre-training run
stopped and resumed is one W&B run whose history equals metrics.jsonl; without wandb installed,
asking for it is a config error."""
from __future__ import annotations

import pytest

from megadiff.config import ConfigError, build_config
from megadiff.observability.metrics import read_metrics
from megadiff.observability.wandb_sink import RUN_ID_FILE
from tests.pretrain_runs import run_pretrain, tiny_overrides
from tests.wandb_log import logged_history_and_config


@pytest.mark.slow
def test_stopped_and_resumed_run_is_one_wandb_run_equal_to_metrics(small_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    overrides = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + [
        f"output_dir={out}", "train.iters=4", "logging.wandb_project=megadiff-tests"]
    run_pretrain(1, overrides + ["train.exit_interval=2"])
    run_pretrain(1, overrides)
    run_id = (out / RUN_ID_FILE).read_text().strip()
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(f"-{run_id}") for d in run_dirs)
    history, config = logged_history_and_config(run_dirs)
    logged = {r["iteration"]: r["lm_loss"] for r in history if "lm_loss" in r}
    expected = {r["iteration"]: r["lm_loss"] for r in read_metrics(out) if "lm_loss" in r}
    assert sorted(expected) == [1, 2, 3, 4]
    assert logged == pytest.approx(expected)
    assert any("lambda/layer_1" in r for r in history)  # nested metrics keep TensorBoard's names
    assert config["model"]["variant"] == "diff" and config["train"]["iters"] == 4


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match="logging.wandb_project: .*pip install wandb"):
        build_config({}, ["logging.wandb_project=x"])
