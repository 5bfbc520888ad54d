"""An adaptation rerun resuming from a damaged DeepSpeed checkpoint: refused by name on every rank (a traceback
from inside torch.load, or DeepSpeed's bare AssertionError, before), the marker's damage before the model loads."""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from megadiff.adapt.resume import DamagedCheckpoint, damage_named, resume_point
from megadiff.adapt.reshard import universal_form
from megadiff.observability.metrics import read_metrics
from tests.distributed import megadiff_main, run_reporting_ranks
from tests.test_adapt_finetune import REPO, _env, adapt_in_ranks, adapt_workspace, finetuned


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return adapt_workspace(tmp_path_factory.mktemp("adapt"))


def _checkpoint(directory: Path, *files: str) -> Path:
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_bytes(b"")
    return directory


def test_the_marker_must_name_a_whole_checkpoint_with_this_ranks_optimizer_state(tmp_path):
    assert resume_point(tmp_path, 0, 2, {}) is None  # no marker: a first run
    whole = _checkpoint(tmp_path / "iter_0000002", "mp_rank_00_model_states.pt",
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _checkpoint(tmp_path / "iter_0000004")  # written in part: no model states
    for tag in ("garbage", "iter_0000004", "iter_0000009", "../iter_0000002"):
        (tmp_path / "latest").write_text(f"{tag}\n")
        with pytest.raises(DamagedCheckpoint, match=rf"latest names '{tag}', which is no whole checkpoint in .*: write "
                                                    r"the one to resume from \(iter_0000002\) into it"):
            resume_point(tmp_path, 0, 2, {})
    (tmp_path / "latest").write_text("iter_0000002\n")
    assert resume_point(tmp_path, 0, 2, {}) == resume_point(tmp_path, 1, 2, {}) == whole
    with pytest.raises(DamagedCheckpoint, match=r"iter_0000002 lacks rank 2's optimizer state"):
        resume_point(tmp_path, 2, 3, {})



def test_this_ranks_optimizer_state_listed_late_is_waited_for(tmp_path, monkeypatch):
    """A requeued job starting seconds after the save, on another node than the rank that wrote this rank's shard:
    NFS listed the shard a moment late, and the rank was refused as lacking its optimizer state. Looked for as
    long as files.appears looks; still missing then, refused."""
    whole = _checkpoint(tmp_path / "iter_0000002", "mp_rank_00_model_states.pt",
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("iter_0000002\n")
    listed_after = {"time": time.monotonic() + 1.0}
    glob = Path.glob

    def listed_late(self, pattern, *args, **kwargs):
        return [path for path in glob(self, pattern, *args, **kwargs)
                if "rank_1_" not in path.name or time.monotonic() >= listed_after["time"]]

    monkeypatch.setattr(Path, "glob", listed_late)
    assert resume_point(tmp_path, 1, 2, {}) == whole
    listed_after["time"] = float("inf")
    monkeypatch.setattr("megadiff.files.VISIBILITY_WAIT_SECONDS", 0.5)
    with pytest.raises(DamagedCheckpoint, match=r"iter_0000002 lacks rank 1's optimizer state"):
        resume_point(tmp_path, 1, 2, {})

class _RunsCodeWhenRead:
    """What a planted pickle can hold: an object whose unpickling calls a function of the planter's choice."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return os.mkdir, (str(self.proof),)


def test_a_checkpoint_file_that_would_run_code_is_refused_unrun(tmp_path):
    """DeepSpeed reads its checkpoint files with torch.load(weights_only=False): a downloaded checkpoint ran the
    code its pickles named as a rerun resumed. Only DeepSpeed's own state types are read."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    checkpoint = _checkpoint(tmp_path / "checkpoints" / "iter_0000002")
    (tmp_path / "checkpoints" / "latest").write_text("iter_0000002")
    torch.save({"module": {"w": torch.ones(2)}, "dp_world_size": 1}, checkpoint / "mp_rank_00_model_states.pt")
    optimizer_file = checkpoint / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    deepspeed_state = {"loss_scaler": DynamicLossScaler(2.0 ** 16, 1000, min_scale=1, delayed_shift=2,
                                                         consecutive_hysteresis=False, dtype=torch.float16),
                       "zero_stage": ZeroStageEnum.gradients,
                       "param_slice_mappings": [{"w": fragment_address(numel=2, start=0)}]}
    torch.save({"optimizer_state_dict": deepspeed_state}, optimizer_file)
    assert resume_point(tmp_path / "checkpoints", 0, 1, {}) == checkpoint  # what DeepSpeed writes is read

    proof = tmp_path / "code_ran"
    torch.save({"optimizer_state_dict": {"loss_scaler": _RunsCodeWhenRead(proof)}}, optimizer_file)
    with pytest.raises(DamagedCheckpoint, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt holds more than "
                                                r"DeepSpeed's checkpoints do \(.*GLOBAL posix.mkdir"):
        resume_point(tmp_path / "checkpoints", 0, 1, {})
    assert not proof.exists()


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory", "x.pt"), EOFError(),
                                   RuntimeError("PytorchStreamReader failed reading zip archive"), AssertionError()])
def test_damage_read_by_deepspeed_is_named(tmp_path, error):
    checkpoint = _checkpoint(tmp_path / "iter_0000004", "mp_rank_00_model_states.pt")
    _checkpoint(tmp_path / "iter_0000002", "mp_rank_00_model_states.pt")
    with pytest.raises(DamagedCheckpoint, match=rf"iter_0000004 cannot be resumed from \({type(error).__name__}: "
                                                r".*The run's other checkpoints: iter_0000002 \(name one in latest\)"):
        with damage_named(checkpoint):
            raise error


def test_running_out_of_memory_while_resuming_is_not_called_damage(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        with damage_named(tmp_path):
            raise torch.OutOfMemoryError("CUDA out of memory")


def test_every_rank_of_a_rerun_names_the_damage(workspace, tmp_path):
    output = tmp_path / "run"
    adapt_in_ranks(workspace, f"output_dir={output}", "checkpoint.exit_interval=2")
    checkpoints, command = output / "checkpoints", ["adapt", str(workspace / "adapt.yaml"), f"output_dir={output}"]
    saved = checkpoints / "iter_0000002"

    def refused() -> str:
        with mock.patch.dict(os.environ, _env(workspace)):
            return run_reporting_ranks(2, megadiff_main, command, timeout=400, expect=3).stderr

    (checkpoints / "latest").write_text("garbage\n")
    assert refused().count("latest names 'garbage', which is no whole checkpoint in ") == 2
    (checkpoints / "latest").write_text("iter_0000002\n")
    shard = next(saved.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    shard.rename(tmp_path / shard.name)
    assert refused().count(f"{saved} lacks rank 1's optimizer state") == 2
    (tmp_path / shard.name).rename(shard)
    model_states = saved / "mp_rank_00_model_states.pt"  # read by both ranks (ZeRO-2)
    model_states.write_bytes(model_states.read_bytes()[:1000])
    assert refused().count(f"{saved} cannot be resumed from (RuntimeError: ") == 2


def _adapt(workspace: Path, world: int, output: Path, *overrides: str):
    with mock.patch.dict(os.environ, _env(workspace)):
        return run_reporting_ranks(world, finetuned, str(workspace / "adapt.yaml"),
                                   [f"output_dir={output}", f"train.grad_accum={4 // world}", *overrides], timeout=400)


def test_a_rerun_on_another_number_of_ranks_trains_on_as_the_uninterrupted_run(workspace, tmp_path):
    """ZeRO keeps the optimizer state (ZeRO-3 the weights too) partitioned among the ranks that wrote it, and
    DeepSpeed loads it into as many: a rerun on an allocation of another size was refused. The checkpoint is
    converted once (rank 0) to DeepSpeed's universal form, each parameter's state whole, which an engine of any
    size loads: 2 ranks stopped at iteration 2 and rerun on 1, and 1 rerun on 2 (grad_accum making the same global
    batch), under ZeRO-2 and ZeRO-3 (partitioned weights), train on as 2 ranks that never stopped."""
    _adapt(workspace, 2, tmp_path / "uninterrupted")
    uninterrupted = read_metrics(tmp_path / "uninterrupted")
    scheduled, measured = ("iteration", "lr"), ("lm_loss", "grad_norm")
    zero3 = f"deepspeed={workspace / 'zero3_all.json'}"
    for written_by, rerun_on, *stage in ((2, 1), (1, 2), (2, 1, zero3)):
        output = tmp_path / f"run{written_by}{rerun_on}{len(stage)}"
        _adapt(workspace, written_by, output, "checkpoint.exit_interval=2", *stage)
        rerun = _adapt(workspace, rerun_on, output, *stage)
        assert rerun.stdout.count(f"was written by {written_by} data-parallel rank(s) and this run has "
                                  f"{rerun_on}: converting it to DeepSpeed's universal checkpoint") == 1
        assert "resuming after iteration 2" in rerun.stdout
        resumed = read_metrics(output)
        assert [r["iteration"] for r in resumed] == [r["iteration"] for r in uninterrupted] == [1, 2, 3, 4]
        for mine, theirs in zip(resumed, uninterrupted):
            assert {k: mine[k] for k in scheduled} == {k: theirs[k] for k in scheduled}
            assert {k: mine[k] for k in measured} == pytest.approx({k: theirs[k] for k in measured}, rel=1e-5), mine
            assert mine["lambda"] == pytest.approx(theirs["lambda"], rel=1e-5)  # learned, in Dex
    # a later rerun on another number of ranks reads the form converted before; one on the writers' has none
    checkpoint = output / "checkpoints" / "iter_0000002"
    with mock.patch("subprocess.run", side_effect=AssertionError("converted again")):
        assert universal_form(checkpoint, 0, 1) == checkpoint / "universal"
        assert universal_form(checkpoint, 0, 2) is None


def test_a_rerun_under_another_checkpoint_format_is_refused_before_the_model_loads(workspace, tmp_path):
    """A ZeRO-2 checkpoint in fp32, rerun under ZeRO-3 or in bf16 (DeepSpeed's files of another name, ZeRO-3's
    partitioned weights): DeepSpeed's load, after the model and its engine were built, called the checkpoint one
    "copied or written in part". Refused on every rank before the model loads, naming both; ZeRO-1, which reads
    ZeRO-2's files, resumes."""
    output = tmp_path / "run"
    adapt_in_ranks(workspace, f"output_dir={output}", "checkpoint.exit_interval=2")
    checkpoint = output / "checkpoints" / "iter_0000002"
    zero3 = f"deepspeed={workspace / 'zero3_all.json'}"
    for change, said in ((zero3, f"{checkpoint} was written under ZeRO-2, and this run's deepspeed config asks for "
                                 "ZeRO-3"),
                         ("train.precision=bf16", f"{checkpoint} was written in fp32, and this run trains in bf16")):
        with mock.patch.dict(os.environ, _env(workspace)):
            rerun = run_reporting_ranks(2, megadiff_main, ["adapt", str(workspace / "adapt.yaml"),
                                                           f"output_dir={output}", change], timeout=400, expect=2)
        assert rerun.stderr.count(said) == 2, rerun.stderr[-2000:]
        assert "Loading weights" not in rerun.stderr + rerun.stdout
    zero1 = f"deepspeed={REPO / 'configs/deepspeed/zero1.json'}"
    assert "resuming after iteration 2" in adapt_in_ranks(workspace, f"output_dir={output}", zero1).stdout


FAKE_CONVERTER = '''
import argparse, os, sys, time
import tqdm
parser = argparse.ArgumentParser()
parser.add_argument("--input_folder")
parser.add_argument("--output_folder")
args, _ = parser.parse_known_args()
print("*** 1. Extracting ZeRO fragments", flush=True)
for _ in tqdm.tqdm(range({items}), mininterval=0):
    time.sleep({seconds})
os.makedirs(os.path.join(args.output_folder, "zero"))
'''


def test_the_universal_conversion_says_how_far_it_is_while_it_runs(tmp_path, monkeypatch, capfd):
    """The converter takes many minutes on a large model's state, and printed nothing (its output was kept for an
    error message). A converter of tqdm's output (carriage returns to a file) stands in for DeepSpeed's."""
    items, seconds, every = 8, 0.5, 1.0
    fake = tmp_path / "fake" / "deepspeed" / "checkpoint"
    fake.mkdir(parents=True)
    for package in (fake.parent, fake):
        (package / "__init__.py").write_text("")
    (fake / "ds_to_universal.py").write_text(FAKE_CONVERTER.format(items=items, seconds=seconds))
    monkeypatch.setenv("PYTHONPATH", str(fake.parents[1]))
    monkeypatch.setattr("megadiff.console.PROGRESS_LINE_SECONDS", every)
    checkpoint = tmp_path / "iter_0000002"
    checkpoint.mkdir()
    torch.save({"dp_world_size": 2}, checkpoint / "mp_rank_00_model_states.pt")
    started = time.monotonic()
    assert universal_form(checkpoint, 0, 1) == checkpoint / "universal"
    measured = time.monotonic() - started
    out = capfd.readouterr().out
    assert "\r" not in out
    said = [line.removeprefix("iter_0000002: converting: ") for line in out.splitlines()[1:-1]]
    done = [int(line.split("|")[2].split("/")[0]) for line in said if "|" in line]  # tqdm's "k/8 [...]"
    # a line a second of a conversion of 4 s, counting what the converter had done
    assert len(said) >= items * seconds / every - 2 and done == sorted(done) and 0 < done[-1] <= items, out
    converted = re.fullmatch(r"iter_0000002: converted in (\d+) s", out.splitlines()[-1])
    assert converted and items * seconds - 0.5 <= int(converted[1]) <= measured + 0.5, out


def test_a_universal_form_shown_late_by_a_shared_filesystem_is_waited_for(tmp_path, monkeypatch):
    """NFS shows a directory another node just made a moment late (its attribute caches): a rank on another node
    than rank 0 looked once and refused a shared checkpoint directory as not shared. Looked for as long as the
    ranks' check of their shared directories looks for rank 0's probe; still missing then, refused."""
    checkpoint = tmp_path / "iter_0000002"
    checkpoint.mkdir()
    torch.save({"dp_world_size": 2}, checkpoint / "mp_rank_00_model_states.pt")
    # rank 0's conversion, renamed into place on another node, that this one's filesystem shows a second late
    threading.Timer(1.0, lambda: (checkpoint / "universal" / "zero").mkdir(parents=True)).start()
    assert universal_form(checkpoint, 1, 1) == checkpoint / "universal"
    unseen = tmp_path / "unseen"
    unseen.mkdir()
    torch.save({"dp_world_size": 2}, unseen / "mp_rank_00_model_states.pt")
    monkeypatch.setattr("megadiff.files.VISIBILITY_WAIT_SECONDS", 0.5)
    with pytest.raises(DamagedCheckpoint, match="is not seen here"):
        universal_form(unseen, 1, 1)
