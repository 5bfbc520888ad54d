"""to-hf / from-hf for every variant from checkpoints written by 2 real ranks (TP=2, PP=2, and
PP=2 interleaved for DIFF):
the Hugging Face models give the logits of the same weights in a single-process megadiff model,
the stock classes load without trust_remote_code, the round trip gives identical tensors, and
bad inputs are refused by name."""
from __future__ import annotations

import errno
import gc
import itertools
import json
import os
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megadiff.checkpoint.format import CheckpointError, checkpoint_config, resolve_checkpoint_dir
from megadiff.config import Config, build_config
from megadiff.convert import ConversionError, convert_from_hf, convert_to_hf, from_hf, to_hf
from megadiff.convert.hf_io import (
    CODE_FILES, EXPORT_STAGING, SAFETENSORS_INDEX, SIDECAR_UNFOLDED as SIDECAR, HFWeights, read_hf_dir,
)
from megadiff.inference import load_checkpoint
from tests.convert_worker import MODEL, VARIANTS, build_tokenizer, reference_model, save_checkpoints, save_in_process
from tests.distributed import run_ranks

PADDED_VOCAB = {"tp2": 512, "pp2": 384, "pp2_vpp2": 384}  # 300 ids padded to 128 x TP
CASES = [(variant, layout) for layout in ("tp2", "pp2") for variant in ("softmax", "diff", "dint", "shared_diff")]
CASES.append(("diff", "pp2_vpp2"))
STOCK_CLASSES = {"softmax": "LlamaForCausalLM", "diff": "DiffLlamaForCausalLM"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    tokenizer = str(build_tokenizer(root / "tokenizer"))
    run_ranks(2, save_checkpoints, str(root), tokenizer,
              {"tp2": list(VARIANTS), "pp2": ["softmax", "diff", "dint", "shared_diff"], "pp2_vpp2": ["diff"]})
    return root


@pytest.fixture(scope="module")
def export(root):
    """export(variant, layout) -> the HF directory, converted (and self-checked) once."""
    done = {}

    def convert(variant: str, layout: str):
        if (variant, layout) not in done:
            done[variant, layout] = convert_to_hf(root / layout / variant, root / "hf" / layout / variant)
        return done[variant, layout]
    return convert


@pytest.fixture(scope="module")
def reference(root):
    return lambda variant, layout: reference_model(checkpoint_config(root / layout / variant))


def tokens(count: int = 20) -> torch.Tensor:
    return torch.randint(0, 300, (2, count), generator=torch.Generator().manual_seed(11))


def load_export(directory, variant: str):
    if variant in STOCK_CLASSES:  # stock transformers classes: no code from the directory
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert type(model).__name__ == STOCK_CLASSES[variant]
        assert type(model).__module__.startswith("transformers.models.")
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
        assert type(model).__name__ == "MegadiffForCausalLM"
    return model.eval()


@pytest.mark.parametrize("variant,layout", CASES)
def test_checkpoint_reshards_into_one_process(root, reference, variant, layout):
    loaded = load_checkpoint(root / layout / variant).parameters_by_name()
    expected = reference(variant, layout).parameters_by_name()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("variant,layout", CASES)
def test_hf_export_gives_megadiff_logits(export, reference, variant, layout):
    model = load_export(export(variant, layout), variant)
    ours = reference(variant, layout)
    assert model.config.vocab_size == ours.vocab_size == PADDED_VOCAB[layout]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens()).logits, ours(tokens()), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("variant,layout", CASES)
def test_round_trip_gives_identical_tensors(root, export, tmp_path, variant, layout, capsys):
    capsys.readouterr()
    back = convert_from_hf(export(variant, layout), tmp_path / "back")
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("megadiff convert:")]
    original = load_checkpoint(root / layout / variant).parameters_by_name()
    # each step as it starts, then with its time (reading, checking, writing a count of parameters)
    assert steps[0].endswith(" ...") and steps[1].startswith(steps[0][:-4] + ": ") and steps[1].endswith(" s")
    assert f"megadiff convert: writing {sum(t.numel() for t in original.values()):,} parameters to" in "\n".join(steps)
    restored = load_checkpoint(back).parameters_by_name()
    assert restored.keys() == original.keys()
    for name, tensor in original.items():
        assert tensor.dtype == restored[name].dtype and torch.equal(tensor, restored[name]), name
    assert checkpoint_config(back).model == checkpoint_config(root / layout / variant).model


def test_a_converted_export_does_not_name_its_run_s_output_dir_or_initial_checkpoint(export, tmp_path):
    """Trained from without output_dir=, the converted checkpoint resumed the exported run in that run's
    output_dir (and wrote into it) instead of loading the converted weights."""
    hf_dir = shutil.copytree(export("diff", "tp2"), tmp_path / "hf")
    sidecar = yaml.safe_load((hf_dir / "megadiff_config.yaml").read_text())
    sidecar["output_dir"], sidecar["checkpoint"]["load"] = str(tmp_path / "the-run"), str(tmp_path / "its-start")
    (hf_dir / "megadiff_config.yaml").write_text(yaml.safe_dump(sidecar))
    converted = checkpoint_config(convert_from_hf(hf_dir, tmp_path / "back", check=False))
    assert (converted.output_dir, converted.checkpoint.load) == (Config().output_dir, None)
    assert converted.model.variant == "diff" and converted.train.lr == sidecar["train"]["lr"]  # the sidecar's


def test_diffllama_holds_head_norm_weight_folded_into_o_proj(root, export, reference, tmp_path):
    hf_dir = export("diff", "tp2")
    params = reference("diff", "tp2").parameters_by_name()
    state = load_file(str(hf_dir / "model.safetensors"))
    prefix = "decoder.layers.1.self_attention."
    norm, proj = params[prefix + "core_attention.head_norm_weight"], params[prefix + "linear_proj.weight"]
    heads = 4
    expected = torch.stack([proj[:, 2 * 8 * h:2 * 8 * (h + 1)] * norm for h in range(heads)], 1).reshape(proj.shape)
    torch.testing.assert_close(state["model.layers.1.self_attn.o_proj.weight"], expected, rtol=1e-6, atol=0)
    # without the sidecar (e.g. a fine-tuned DiffLlama): unit head-norm weights, o_proj as the projection
    bare = shutil.copytree(hf_dir, tmp_path / "bare")
    (bare / "megadiff_unfolded.safetensors").unlink()
    back = load_checkpoint(convert_from_hf(bare, tmp_path / "back"))
    restored = back.parameters_by_name()
    assert torch.equal(restored[prefix + "core_attention.head_norm_weight"], torch.ones(16))
    assert torch.equal(restored[prefix + "linear_proj.weight"], state["model.layers.1.self_attn.o_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()), reference("diff", "tp2")(tokens()), rtol=1e-4, atol=2e-5)


def test_a_diffllama_export_fine_tuned_since_keeps_its_o_proj(root, export, tmp_path):
    """The sidecar's pre-fold tensors are restored only while o_proj is still their fold: an export fine-tuned
    since (o_proj changed, the sidecar left as it was) must come back as its o_proj, not as the stale tensors."""
    bare = shutil.copytree(export("diff", "tp2"), tmp_path / "tuned")
    state = load_file(str(bare / "model.safetensors"))
    tuned = "model.layers.1.self_attn.o_proj.weight"
    state[tuned] = state[tuned] * 1.5
    save_file(state, str(bare / "model.safetensors"), metadata={"format": "pt"})
    restored = load_checkpoint(convert_from_hf(bare, tmp_path / "back")).parameters_by_name()
    prefix = "decoder.layers.1.self_attention."
    assert torch.equal(restored[prefix + "linear_proj.weight"], state[tuned])
    assert torch.equal(restored[prefix + "core_attention.head_norm_weight"], torch.ones(16))
    untouched = load_checkpoint(root / "tp2" / "diff").parameters_by_name()  # layer 0 still matches its sidecar
    for name in ("linear_proj.weight", "core_attention.head_norm_weight"):
        name = "decoder.layers.0.self_attention." + name
        assert torch.equal(restored[name], untouched[name]), name


def test_an_export_whose_config_json_was_edited_converts_as_config_json_says(root, export, tmp_path, capsys):
    """The export's own run config (the sidecar) is kept only while it describes config.json: a window edited in
    config.json since (a context extension by hand) must come back, not the sidecar's."""
    edited = shutil.copytree(export("diff", "tp2"), tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    config["max_position_embeddings"] *= 2
    (edited / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    back = convert_from_hf(edited, tmp_path / "back")
    assert "megadiff_config.yaml does not describe config.json" in capsys.readouterr().out
    assert checkpoint_config(back).model.seq_length == config["max_position_embeddings"]
    assert checkpoint_config(convert_from_hf(export("diff", "tp2"), tmp_path / "as_exported")).model == \
        checkpoint_config(root / "tp2" / "diff").model


def test_pad_vocab_refuses_rows_the_exports_tensor_parallel_size_does_not_divide(export, tmp_path):
    """A megadiff export keeps its run's parallel.tensor=2: 171 pads its 512 rows to 513, which two ranks cannot
    split."""
    with pytest.raises(ConversionError, match=r"--pad-vocab 171 gives 513 rows, which the export's "
                                              r"parallel.tensor=2 does not divide: pass a multiple of 2"):
        convert_from_hf(export("diff", "tp2"), tmp_path / "back", pad_vocab=171, check=False)


def test_a_bf16_export_of_an_fp32_run_comes_back_with_its_head_norm_weights(root, tmp_path):
    """The sidecar holds the pre-fold tensors in the export's dtype, o_proj is folded from them: from-hf
    recognises the fold and restores the norm weights (not unit ones with the norm merged into o_proj)."""
    checkpoint = root / "tp2" / "diff"
    hf_dir = convert_to_hf(checkpoint, tmp_path / "hf", dtype="bf16")
    restored = load_checkpoint(convert_from_hf(hf_dir, tmp_path / "back")).parameters_by_name()
    source = load_checkpoint(checkpoint).parameters_by_name()
    for name in ("core_attention.head_norm_weight", "linear_proj.weight"):
        name = "decoder.layers.1.self_attention." + name
        assert torch.equal(restored[name], source[name].to(torch.bfloat16)), name
    # lambda's vectors stay fp32 (exp of their dot products is sensitive), as trained; the rest is bf16
    state = load_file(str(hf_dir / "model.safetensors"))
    lambdas = {name: t for name, t in state.items() if ".lambda_" in name}
    assert len(lambdas) == 4 * checkpoint_config(checkpoint).model.num_layers
    assert all(t.dtype == torch.bfloat16 for name, t in state.items() if name not in lambdas)
    for name, tensor in lambdas.items():
        layer, vector = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(lambda_[qk][12])", name).groups()
        original = source[f"decoder.layers.{layer}.self_attention.core_attention.{vector}"]
        assert tensor.dtype == torch.float32 and torch.equal(tensor, original.float()), name


def test_an_export_into_an_earlier_exports_directory_keeps_none_of_its_files(root, tmp_path):
    """A chat run exported into the directory first: the base run's export must not chat with its template."""
    from transformers import AutoTokenizer

    hf_dir = tmp_path / "hf"
    convert_to_hf(root / "tp2" / "diff", hf_dir, check=False)
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert AutoTokenizer.from_pretrained(hf_dir).chat_template is not None
    convert_to_hf(root / "tp2" / "diff", hf_dir, check=False)
    assert AutoTokenizer.from_pretrained(hf_dir).chat_template is None


def test_an_export_failing_part_way_leaves_the_earlier_export_whole(root, reference, tmp_path, monkeypatch):
    """Written in place, a re-export deleted the earlier one's shards before writing its own: a full disk or a
    kill part way lost both. Written aside and moved in when whole, the earlier export still loads, nothing
    of the failed one is left, and a file of the user's in the directory stays through every export."""
    import errno

    import safetensors.torch

    hf_dir = convert_to_hf(root / "tp2" / "diff", tmp_path / "hf", check=False)
    (hf_dir / "NOTES.md").write_text("the user's own")
    before = {path.name: path.read_bytes() for path in hf_dir.iterdir()}

    def disk_full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    with monkeypatch.context() as patched:
        patched.setattr(safetensors.torch, "save_file", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            convert_to_hf(root / "tp2" / "shared_diff", hf_dir, check=False)
    assert {path.name: path.read_bytes() for path in hf_dir.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]  # no staging directory left
    with torch.no_grad():
        torch.testing.assert_close(load_export(hf_dir, "diff")(input_ids=tokens()).logits,
                                   reference("diff", "tp2")(tokens()), rtol=1e-4, atol=2e-5)
    convert_to_hf(root / "tp2" / "shared_diff", hf_dir, check=False)  # remote code in place of DiffLlama
    with torch.no_grad():
        torch.testing.assert_close(load_export(hf_dir, "shared_diff")(input_ids=tokens()).logits,
                                   reference("shared_diff", "tp2")(tokens()), rtol=1e-4, atol=2e-5)
    assert (hf_dir / "NOTES.md").read_text() == "the user's own"
    assert not (hf_dir / "megadiff_unfolded.safetensors").exists()  # DiffLlama's sidecar, not this export's
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]
    assert not list(hf_dir.glob(".*"))  # nor the staging directory inside


def _files(directory: Path) -> dict[str, bytes]:
    """A directory's files and their bytes (not the staging directory)."""
    return {path.name: path.read_bytes() for path in directory.iterdir() if path.is_file()}


def _steps_in(monkeypatch, directory: Path, kill_at: int | None = None) -> list[str]:
    """Patches os.replace and Path.unlink to record each step of an export in `directory` (a rename into it,
    a removal of one of its files) as 'replace NAME' or 'unlink NAME', and with `kill_at`, to raise
    KeyboardInterrupt in place of that step (numbered from 0): a kill there, nothing after it done."""
    from megadiff.convert import hf_io

    steps, replace, unlink = [], os.replace, Path.unlink

    def step(kind: str, path) -> None:
        if Path(path).parent == directory:
            if len(steps) == kill_at:
                raise KeyboardInterrupt
            steps.append(f"{kind} {Path(path).name}")

    def replacing(source, target):
        step("replace", target)
        return replace(source, target)

    def unlinking(path, missing_ok=False):
        step("unlink", path)
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(hf_io.os, "replace", replacing)
    monkeypatch.setattr(Path, "unlink", unlinking)
    return steps


def test_a_sharded_export_removes_the_earlier_config_first_and_moves_its_index_then_its_config_last(
        root, tmp_path, monkeypatch):
    """config.json names the architecture and the index the shards: moved in before the files they name (or
    before the earlier export's files are removed), a kill left them naming files not yet there or stale ones."""
    from megadiff.convert import hf_io

    hf_dir = convert_to_hf(root / "tp2" / "diff", tmp_path / "hf", check=False)  # one file, replaced by shards
    monkeypatch.setattr(hf_io, "MAX_SHARD_SIZE", "100KB")
    steps = _steps_in(monkeypatch, hf_dir)
    convert_to_hf(root / "tp2" / "diff", hf_dir, check=False)
    moved = [step.removeprefix("replace ") for step in steps if step.startswith("replace ")]
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 3
    assert sorted(moved) == sorted(_files(hf_dir)) and "unlink model.safetensors" in steps
    assert steps[0] == "unlink config.json"
    assert steps[-2:] == [f"replace {SAFETENSORS_INDEX}", "replace config.json"]


@pytest.mark.parametrize("earlier,later", [(("shared_diff", "200KB"), ("diff", "5GB")),
                                           (("diff", "5GB"), ("shared_diff", "200KB"))],
                         ids=["shards_then_one_file", "one_file_then_shards"])
def test_an_export_killed_at_any_step_of_its_moves_leaves_the_earlier_export_or_none_a_reader_takes(
        root, tmp_path, monkeypatch, earlier, later):
    """Moved in file by file, an export killed between two steps left a mix: new weights under the earlier
    config.json, or (shards replaced by one file) the new config.json beside the earlier index, which from-hf
    reads before model.safetensors: the earlier shards taken for the new model. Killed at each step in turn,
    the directory is the earlier export as it was or lacks config.json, which transformers and from-hf refuse;
    the next export leaves what one into an empty directory does (with the remote code of neither)."""
    from transformers import AutoConfig

    from megadiff.convert import hf_io

    def export(variant_and_shard_size, directory):
        variant, shard_size = variant_and_shard_size
        monkeypatch.setattr(hf_io, "MAX_SHARD_SIZE", shard_size)
        return convert_to_hf(root / "tp2" / variant, directory, check=False)

    before, after = _files(export(earlier, tmp_path / "earlier")), _files(export(later, tmp_path / "later"))
    assert (SAFETENSORS_INDEX in before) != (SAFETENSORS_INDEX in after)
    hf_dir = tmp_path / "hf"
    for kill_at in itertools.count():
        shutil.rmtree(hf_dir, ignore_errors=True)
        shutil.copytree(tmp_path / "earlier", hf_dir)
        with monkeypatch.context() as patched:
            steps = _steps_in(patched, hf_dir, kill_at)
            try:
                export(later, hf_dir)
                break
            except KeyboardInterrupt:
                pass
        left = _files(hf_dir)
        if left != before:
            assert "config.json" not in left, f"killed after {steps}"
            with pytest.raises(ConversionError, match="no config.json"):
                read_hf_dir(hf_dir)
            with pytest.raises((OSError, ValueError), match="config.json"):  # "Unrecognized model ... config.json"
                AutoConfig.from_pretrained(hf_dir)
    assert kill_at == len(steps) > len(after)  # every step was a kill point
    assert _files(hf_dir) == after and not (hf_dir / EXPORT_STAGING).exists()
    shutil.rmtree(hf_dir)
    shutil.copytree(tmp_path / "earlier", hf_dir)
    with monkeypatch.context() as patched:
        _steps_in(patched, hf_dir, kill_at // 2)
        with pytest.raises(KeyboardInterrupt):
            export(later, hf_dir)
    assert (hf_dir / EXPORT_STAGING).is_dir()
    export(later, hf_dir)
    assert _files(hf_dir) == after and not (hf_dir / EXPORT_STAGING).exists()


def test_a_failing_export_removes_the_directory_it_made_and_keeps_the_one_it_was_given(root, tmp_path, monkeypatch):
    """Failing, an export into a new directory leaves nothing (an empty directory named as the model); one
    into an existing empty directory, the user's (a mount point, a directory with its permissions), keeps it."""
    import safetensors.torch

    def disk_full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    (tmp_path / "given").mkdir()
    for save in ("made", "given"):
        with pytest.raises(OSError, match="No space left on device"):
            convert_to_hf(root / "tp2" / "diff", tmp_path / save, check=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["given"]
    assert not any((tmp_path / "given").iterdir())


def test_an_export_interrupted_while_writing_leaves_no_staging_directory(root, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt, no Exception) while the shards were written left them, a model's size, in the
    staging directory until the next export, and the directory made for the export; it still stops the export."""
    import safetensors.torch

    def interrupted(tensors, filename, metadata=None):
        raise KeyboardInterrupt

    hf_dir = convert_to_hf(root / "tp2" / "diff", tmp_path / "hf", check=False)
    before = _files(hf_dir)
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    for save in (hf_dir, tmp_path / "new"):
        with pytest.raises(KeyboardInterrupt):
            convert_to_hf(root / "tp2" / "shared_diff", save, check=False)
    assert _files(hf_dir) == before and not (hf_dir / EXPORT_STAGING).exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


def test_an_export_failing_its_check_leaves_the_earlier_one_as_it_was(root, tmp_path, monkeypatch):
    """The check reads the export where it was staged: failing, it left the new files in --save in place of a
    good export's. A new directory is removed as on any failure."""
    from megadiff.convert import to_hf
    from megadiff.convert.check import Thresholds

    hf_dir = convert_to_hf(root / "tp2" / "diff", tmp_path / "hf", check=False)
    before = _files(hf_dir)
    monkeypatch.setattr(to_hf, "thresholds_for", lambda *dtypes: Thresholds(max_abs_diff=0.0, top1_agreement=2.0))
    for save in (hf_dir, tmp_path / "new"):
        with pytest.raises(ConversionError, match="check failed"):
            convert_to_hf(root / "tp2" / "shared_diff", save)
    assert _files(hf_dir) == before and not (hf_dir / EXPORT_STAGING).exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


def test_a_stock_export_over_a_remote_code_one_leaves_none_of_its_code(root, tmp_path):
    """A DiffLlama export over a remote-code one kept modeling_megadiff.py and configuration_megadiff.py: the
    directory then reads (and is shared) as a remote-code model, with code that is not its model's."""
    hf_dir = convert_to_hf(root / "tp2" / "shared_diff", tmp_path / "hf", check=False)
    assert all((hf_dir / name).is_file() for name in CODE_FILES)
    convert_to_hf(root / "tp2" / "diff", hf_dir, check=False)
    fresh = convert_to_hf(root / "tp2" / "diff", tmp_path / "fresh", check=False)
    assert not any((hf_dir / name).exists() for name in CODE_FILES)
    assert sorted(_files(hf_dir)) == sorted(_files(fresh))


def test_to_hf_refuses_a_file_for_save_before_reading_and_takes_the_working_directory(root, tmp_path, monkeypatch):
    """A file named as --save (or a link to nothing) failed after the whole export was written; '.' (no name
    of its own to stage beside) is the directory the command runs in."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    monkeypatch.setattr(to_hf, "load_checkpoint", lambda *a, **k: pytest.fail("weights were read"))
    for save in ("file", "dangling"):
        with pytest.raises(ConversionError, match=f"--save .*{save} is a file; to-hf writes a directory"):
            convert_to_hf(root / "tp2" / "diff", tmp_path / save, check=False)
    with pytest.raises(ConversionError, match="--save .*file/hf lies under .*file, a file; to-hf writes a directory"):
        convert_to_hf(root / "tp2" / "diff", tmp_path / "file" / "hf", check=False)
    # the run itself, or one of its checkpoints: the export's files among the training files
    checkpoint = resolve_checkpoint_dir(root / "tp2" / "diff")
    for save in (root / "tp2" / "diff", checkpoint):
        with pytest.raises(ConversionError, match="holds a megadiff run or checkpoint: give the export a directory"):
            convert_to_hf(root / "tp2" / "diff", save, check=False)
    monkeypatch.undo()
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    convert_to_hf(root / "tp2" / "diff", ".", check=False)
    assert (tmp_path / "here" / "config.json").is_file() and not list((tmp_path / "here").glob(".*"))


def test_a_sharded_export_copies_one_shard_at_a_time_and_replaces_an_earlier_exports_shards(
        root, reference, tmp_path, monkeypatch):
    """Shards of 100 KB: when each is written, only its own tensors' copies are alive (the views of
    merged weights share storage, so they are copied, but not the whole model at once); transformers
    and from-hf read the index; an export of one file then leaves none of the shards behind."""
    import safetensors.torch

    from megadiff.convert import hf_io

    copies, alive_per_shard = [], []
    own, save = hf_io._owned_copies, safetensors.torch.save_file

    def recording(tensors):
        owned = own(tensors)
        copies.extend(weakref.ref(tensor) for tensor in owned.values())
        return owned

    def counting(tensors, filename, metadata=None):
        gc.collect()
        alive_per_shard.append((sum(ref() is not None for ref in copies), len(tensors)))
        return save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_io, "_owned_copies", recording)
    monkeypatch.setattr(safetensors.torch, "save_file", counting)
    monkeypatch.setattr(hf_io, "MAX_SHARD_SIZE", "100KB")
    hf_dir = convert_to_hf(root / "tp2" / "diff", tmp_path / "hf", check=False)
    shards = sorted(path.name for path in hf_dir.glob("model-*.safetensors"))
    assert len(shards) > 3 and (hf_dir / "model.safetensors.index.json").is_file()
    assert all(alive == count for alive, count in alive_per_shard[:len(shards)]), alive_per_shard
    with torch.no_grad():
        torch.testing.assert_close(load_export(hf_dir, "diff")(input_ids=tokens()).logits,
                                   reference("diff", "tp2")(tokens()), rtol=1e-4, atol=2e-5)
    back = load_checkpoint(convert_from_hf(hf_dir, tmp_path / "back")).parameters_by_name()
    for name, tensor in load_checkpoint(root / "tp2" / "diff").parameters_by_name().items():
        assert torch.equal(back[name], tensor), name
    monkeypatch.setattr(hf_io, "MAX_SHARD_SIZE", "5GB")
    convert_to_hf(root / "tp2" / "diff", hf_dir, check=False)
    assert sorted(path.name for path in hf_dir.glob("model*.safetensors*")) == ["model.safetensors"]


def test_remote_code_asked_for_a_softmax_model_is_said_to_export_stock_llama(root, tmp_path, capsys):
    capsys.readouterr()
    hf_dir = convert_to_hf(root / "tp2" / "softmax", tmp_path / "hf", check=False, remote_code=True)
    assert "--remote-code: a softmax model exports as the stock LlamaForCausalLM" in capsys.readouterr().out
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not any(hf_dir.glob("*.py"))


def test_constant_lambda_diff_is_refused_as_diffllama_and_exports_with_remote_code(root, reference, tmp_path):
    checkpoint = root / "tp2" / "diff_constant_lambda"
    with pytest.raises(ConversionError, match="constant 0.8.*DiffLlama.*--remote-code"):
        convert_to_hf(checkpoint, tmp_path / "stock")
    model = load_export(convert_to_hf(checkpoint, tmp_path / "hf", remote_code=True), "diff_constant_lambda")
    assert model.config.lambda_init == 0.8
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens()).logits, reference("diff_constant_lambda", "tp2")(tokens()),
                                   rtol=1e-4, atol=2e-5)


def _rewrite_weights(directory, edit) -> None:
    path = str(directory / "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def _rewrite_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("mutation,message", [
    (lambda d: _rewrite_weights(d, lambda s: s.update({"model.layers.0.self_attn.extra": torch.zeros(3)})),
     r"unknown tensor model\.layers\.0\.self_attn\.extra"),
    (lambda d: _rewrite_weights(d, lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
     r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"),
    (lambda d: _rewrite_config(d, intermediate_size=64),
     r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(96, 64\), expected \(64, 64\)"),
    (lambda d: _rewrite_config(d, model_type="gpt2"), r"model_type 'gpt2' is not convertible"),
], ids=["unknown", "missing", "shape", "model_type"])
def test_from_hf_refuses_mismatched_directories(export, tmp_path, mutation, message):
    broken = shutil.copytree(export("diff", "tp2"), tmp_path / "broken")
    mutation(broken)
    with pytest.raises(ConversionError, match=message):
        convert_from_hf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_to_hf_refuses_checkpoint_that_does_not_match_its_config(root, tmp_path):
    broken = shutil.copytree(root / "tp2" / "softmax", tmp_path / "broken")
    config = yaml.safe_load((broken / "config.yaml").read_text())
    config["model"]["ffn_hidden_size"] = 64
    (broken / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match=r"linear_fc2\.weight has shape \(2, 64, 96\), the config gives "
                                               r"\(2, 64, 64\)"):
        convert_to_hf(broken, tmp_path / "hf")


def _record(module, monkeypatch, name: str, objects_of) -> list[weakref.ref]:
    """Patches `module`'s function `name` to keep weak references to what `objects_of(its arguments,
    its result)` gives."""
    refs, original = [], getattr(module, name)

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        refs.extend(weakref.ref(thing) for thing in objects_of(args, result))
        return result
    monkeypatch.setattr(module, name, recording)
    return refs


def _alive_when(module, monkeypatch, name: str, *recorded: list[weakref.ref]) -> list[int]:
    """Patches `module`'s function `name` to count, as each call starts, what of `recorded` is alive."""
    alive, original = [], getattr(module, name)

    def counting(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for refs in recorded for ref in refs))
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, counting)
    return alive


def test_conversions_free_what_they_converted_and_hold_one_fp32_model_at_a_time(tmp_path, monkeypatch):
    """The check's fp32 models are 52 GB each for 13B: to-hf's exported tensors (views that also keep
    the bf16 source model alive) must not stay beside them, nor from-hf's read ones (the model again,
    and its merged QKV and fc1 weights: 26 to 44 GB more for 13B in bf16), which it reads one layer at
    a time; nor the megadiff model beside the Hugging Face one."""
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    cfg = build_config({}, MODEL + VARIANTS["diff"] + [f"data.tokenizer={tokenizer}", "train.precision=bf16"])
    save_in_process(cfg, tmp_path / "checkpoint")
    megadiff_models = {module: _record(module, monkeypatch, "megadiff_logits", lambda args, _: [args[0].gpt])
                       for module in (to_hf, from_hf)}
    exported, original_export = [], to_hf.megatron_to_hf_parts

    def exporting(params, dims, extras):
        for part in original_export(params, dims, extras):
            exported.extend(weakref.ref(tensor) for tensor in [*part.values(), *extras.values()])
            yield part
    monkeypatch.setattr(to_hf, "megatron_to_hf_parts", exporting)
    read, read_refs, layers_held = [], [], []  # the layer of every tensor read; the layers alive at each read
    original_read = HFWeights.__getitem__

    def reading(weights, name):
        gc.collect()
        layers_held.append({layer for layer, ref in zip(read, read_refs) if ref() is not None and layer is not None})
        tensor = original_read(weights, name)
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        read.append(layer and int(layer[1]))
        read_refs.append(weakref.ref(tensor))
        return tensor
    monkeypatch.setattr(HFWeights, "__getitem__", reading)
    merged, original_merge = [], from_hf.hf_to_megatron

    def merging(*args):
        for part in original_merge(*args):
            merged.extend(weakref.ref(tensor) for tensor in part.values())
            yield part
    monkeypatch.setattr(from_hf, "hf_to_megatron", merging)
    at_checks = [_alive_when(to_hf, monkeypatch, "megadiff_logits", exported),
                 _alive_when(from_hf, monkeypatch, "megadiff_logits", read_refs, merged)]
    at_hf_loads = [_alive_when(module, monkeypatch, "load_hf_model", megadiff_models[module])
                   for module in (to_hf, from_hf)]
    convert_from_hf(convert_to_hf(tmp_path / "checkpoint", tmp_path / "hf"), tmp_path / "back")
    assert at_checks == [[0], [0]] and at_hf_loads == [[0], [0]]
    assert max(map(len, layers_held)) == 1  # the layer being read, never an earlier one
    assert set(read) == {None, 0, 1} and merged and exported and all(megadiff_models.values())


@pytest.mark.parametrize("dtype", [None, "fp32", "fp16"], ids=["bf16", "fp32", "fp16"])
def test_from_hf_checks_with_one_fp32_model_in_memory_and_writes_what_it_writes_unchecked(tmp_path, monkeypatch,
                                                                                           dtype):
    """from-hf's check held its fp32 model beside the converted one (bf16: 6 bytes a parameter, 420 GB for a Llama
    70B that --no-check converts in 140), and an fp32 conversion the converted model beside the Hugging Face one
    (8 bytes a parameter). The tensors live as each side's logits are computed are one fp32 model and less than a
    layer more, and the checkpoint is the one --no-check writes, tensor for tensor."""
    from tests.memory_worker import live_tensor_bytes, tensor_bytes_after

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    cfg = build_config({}, MODEL + VARIANTS["diff"] + [f"data.tokenizer={tokenizer}", "train.precision=bf16",
                                                       "model.num_layers=6"])
    save_in_process(cfg, tmp_path / "checkpoint")
    hf_dir = convert_to_hf(tmp_path / "checkpoint", tmp_path / "hf", check=False)
    unchecked = load_checkpoint(convert_from_hf(hf_dir, tmp_path / "unchecked", dtype=dtype, check=False))
    fp32_model = sum(t.numel() for t in unchecked.parameters_by_name().values()) * 4
    layer = sum(t.numel() for name, t in unchecked.parameters_by_name().items() if ".layers.0." in name) * 4
    gc.collect()
    before = live_tensor_bytes()
    at_ours, at_theirs = (tensor_bytes_after(from_hf, name, monkeypatch) for name in ("megadiff_logits",
                                                                                       "load_hf_model"))
    checked = load_checkpoint(convert_from_hf(hf_dir, tmp_path / "checked", dtype=dtype))
    at_checks = at_ours + at_theirs
    assert len(at_checks) == 2 and max(at_checks) - before < fp32_model + layer, (at_checks, before, fp32_model)
    for (name, tensor), (_, expected) in zip(checked.parameters_by_name().items(),
                                             unchecked.parameters_by_name().items(), strict=True):
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name


def _weight_bytes(model, names_ending: str = "") -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith(names_ending))


def test_a_loaded_checkpoint_is_held_once_while_it_is_read(tmp_path, monkeypatch):
    """dist_checkpointing reads SwiGLU's fc1 into its halves (views of the parameter) and merged them with torch.cat
    after the load: every fc1 weight once more (about 40% of a SwiGLU model: 11 GB for 13B in bf16, on the GPU where
    the model sits) while load_checkpoint (to-hf, generate, evaluate) read a checkpoint. The tensors live as the read
    ends are the model's alone, and it holds the saved weights."""
    from megatron.core import dist_checkpointing

    from tests.memory_worker import live_tensor_bytes, tensor_bytes_after

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    cfg = build_config({}, MODEL + VARIANTS["softmax"] + [f"data.tokenizer={tokenizer}", "model.ffn_hidden_size=384"])
    saved = save_in_process(cfg, tmp_path / "checkpoint").gpt
    weights, fc1 = _weight_bytes(saved), _weight_bytes(saved, "linear_fc1.weight")
    assert fc1 > weights / 3
    before = live_tensor_bytes()
    held = tensor_bytes_after(dist_checkpointing, "load", monkeypatch)
    loaded = load_checkpoint(tmp_path / "checkpoint").gpt
    assert weights <= held[0] - before < weights + fc1 / 10, (held[0] - before, weights, fc1)
    for (name, tensor), (_, expected) in zip(loaded.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(tensor, expected), name


def test_a_converted_checkpoint_is_written_from_the_model_alone_and_as_megatron_writes_it(tmp_path, monkeypatch):
    """from-hf writes its checkpoint from the model on the host: dist_checkpointing's writer cloned every host
    tensor that is a view before writing any, SwiGLU's fc1 halves among them (about 40% of a SwiGLU model: 75 GB
    for a converted Llama 70B in bf16, beside its 140 GB). The tensors live once the writer has taken its data are
    the model's alone, and the files are byte for byte those of megatron's own save."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megadiff.checkpoint.format import model_sharded_state
    from megadiff.checkpoint.weights import save_model_weights
    from tests.memory_worker import live_tensor_bytes, tensor_bytes_after

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    cfg = build_config({}, MODEL + VARIANTS["softmax"] + [f"data.tokenizer={tokenizer}", "model.ffn_hidden_size=384"])
    model = reference_model(cfg).gpt
    weights, fc1 = _weight_bytes(model), _weight_bytes(model, "linear_fc1.weight")
    assert fc1 > weights / 3
    (tmp_path / "megatron").mkdir()
    dist_checkpointing.save(model_sharded_state([model]), str(tmp_path / "megatron"))
    before = live_tensor_bytes()
    held = tensor_bytes_after(FileSystemWriterAsync, "prepare_write_data", monkeypatch)
    save_model_weights([model], cfg, tmp_path / "converted")
    assert held[0] - before < fc1 / 10, (held[0] - before, weights, fc1)
    written = sorted(path.name for path in (tmp_path / "megatron").iterdir())
    assert written == sorted(path.name for path in (tmp_path / "converted").iterdir() if path.name != "config.yaml")
    for name in written:
        if name == ".metadata":  # naming its directory and a save id of its own, as any two saves' do
            assert _metadata_but_the_save(tmp_path / "megatron") == _metadata_but_the_save(tmp_path / "converted")
        else:
            assert (tmp_path / "megatron" / name).read_bytes() == (tmp_path / "converted" / name).read_bytes(), name


def _metadata_but_the_save(checkpoint: Path) -> dict:
    import pickle

    with open(checkpoint / ".metadata", "rb") as file:  # a test's own checkpoint
        return {key: value for key, value in vars(pickle.load(file)).items() if key != "storage_meta"}


def _exported_at_once(checkpoint: Path, dtype: torch.dtype, directory: Path) -> None:
    """The reference: every tensor converted (and cast) first, then split and written by huggingface_hub's
    helpers, each shard from contiguous copies."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from megadiff.convert.hf_config import choose_family
    from megadiff.convert.hf_layout import Dims, megatron_to_hf

    cfg = checkpoint_config(checkpoint)
    params = {name: tensor if name.endswith(to_hf.FP32_SUFFIXES) else tensor.to(dtype)
              for name, tensor in load_checkpoint(checkpoint).parameters_by_name().items()}
    state, extras = megatron_to_hf(params, Dims.of(cfg.model, choose_family(cfg.model, False)))
    split = split_torch_state_dict_into_shards(state, max_shard_size="100KB")
    directory.mkdir()
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name].contiguous().clone() for name in names}, str(directory / filename),
                  metadata={"format": "pt"})
    (directory / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": split.metadata,
                                                           "weight_map": split.tensor_to_filename}, indent=2))
    save_file({name: tensor.contiguous().clone() for name, tensor in extras.items()}, str(directory / SIDECAR),
              metadata={"format": "pt"})


def test_to_hf_converts_a_layer_at_a_time_as_it_writes_the_shards(tmp_path, monkeypatch):
    """to-hf converted every tensor first: the QKV weights regrouped (copies), and with --dtype every weight cast,
    all held beside the source model until the last shard was written (a bf16 13B exported in fp32: 26 + 52 GB).
    Exported in fp32 from bf16 in shards of 100 KB, the tensors live as each shard is written are the source's and
    less than a sixth of the export more (a layer's conversion and the shards being written); the files are those
    of the conversion done at once, byte for byte."""
    import safetensors.torch

    from megadiff.convert import hf_io
    from tests.memory_worker import live_tensor_bytes

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    cfg = build_config({}, MODEL + VARIANTS["diff"] + [f"data.tokenizer={tokenizer}", "train.precision=bf16",
                                                       "model.num_layers=8"])
    weights = _weight_bytes(save_in_process(cfg, tmp_path / "checkpoint").gpt)
    gc.collect()
    before, held, save = live_tensor_bytes(), [], safetensors.torch.save_file

    def measuring(tensors, filename, metadata=None):
        held.append(live_tensor_bytes())
        return save(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", measuring)
    monkeypatch.setattr(hf_io, "MAX_SHARD_SIZE", "100KB")
    hf_dir = convert_to_hf(tmp_path / "checkpoint", tmp_path / "hf", dtype="fp32", check=False)
    shards = sorted(path.name for path in hf_dir.glob("model-*.safetensors"))
    assert len(shards) > 8 and len(held) == len(shards) + 1  # and the sidecar
    monkeypatch.undo()
    _exported_at_once(tmp_path / "checkpoint", torch.float32, tmp_path / "reference")
    layer = sum(tensor.nbytes for name, tensor in load_file(hf_dir / SIDECAR).items() if ".0." in name) + sum(
        tensor.nbytes for shard in shards for name, tensor in load_file(hf_dir / shard).items() if ".layers.0." in name)
    shard = max((hf_dir / name).stat().st_size for name in shards)
    sidecar = (hf_dir / SIDECAR).stat().st_size  # DiffLlama's unfolded tensors, cast as the layers are converted
    assert max(held[:-1]) - before - weights < layer + 2 * shard + sidecar  # the shard's tensors and their copies
    written = sorted(path.name for path in hf_dir.glob("*.safetensors*"))
    assert written == sorted(path.name for path in (tmp_path / "reference").iterdir())
    for name in written:
        assert (hf_dir / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name
