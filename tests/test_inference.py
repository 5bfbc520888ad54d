"""load_checkpoint (every --load path form) gives the in-process model's logits [B, N, V_padded];
a KV-cached forward, a prompt then a token at a time, gives the whole sequence's logits (every
variant); `megadiff generate` prints greedy text equal to a naive argmax loop (past the window
too), and seeded sampling that is reproducible and stays within the top-k."""
from __future__ import annotations

import io
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

import megadiff.inference.generate as generate_module
from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, CheckpointError, iteration_dir
from megadiff.cli import main
from megadiff.config import build_config
from megadiff.data.conversations import encode_conversation
from megadiff.data.tokenizers import load_tokenizer
from megadiff.inference import load_checkpoint
from megadiff.inference.generate import (
    HeldContext, TextStream, decodable_ids, generate, generate_batch, next_tokens, stop_texts_check,
)
from megadiff.inference.icl import SharedContext, constrained_answer
from tests.convert_worker import build_tokenizer, reference_model, save_in_process, variant_config
from tests.hostile_files import OpensAFile
from tests.test_icl import naive_answer

PROMPT = "In the beginning"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory (checkpoints/iter_0000007 + latest marker) and the model it holds."""
    root = tmp_path_factory.mktemp("inference")
    cfg = variant_config("dint", "single", str(build_tokenizer(root / "tokenizer")))
    output_dir = root / "run"
    reference = save_in_process(cfg, iteration_dir(output_dir / CHECKPOINTS_DIR, 7))
    (output_dir / CHECKPOINTS_DIR / LATEST_FILE).write_text("7")
    return output_dir, reference


@pytest.mark.parametrize("form", ["output_dir", "checkpoints_dir", "iteration_dir"])
def test_load_checkpoint_gives_in_process_logits(run, form):
    output_dir, reference = run
    path = {"output_dir": output_dir, "checkpoints_dir": output_dir / CHECKPOINTS_DIR,
            "iteration_dir": iteration_dir(output_dir / CHECKPOINTS_DIR, 7)}[form]
    model = load_checkpoint(path)
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (3, 9, 384)  # 300 ids padded to a multiple of 128
        assert torch.equal(logits, reference(ids))


def test_chunked_losses_and_chosen_logits_equal_megatrons_whole_forward(run):
    """CausalLM's losses (output layer + cross entropy a few positions at a time), logits and
    next-token logits against GPTModel.forward's own, which holds every position's logits."""
    model = load_checkpoint(run[0])
    model.loss_chunk_tokens = 5  # batch 2: 2 positions per chunk, the last of 9 alone
    generator = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 300, (2, 9), generator=generator) for _ in range(2))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        whole = model.gpt(ids, positions, None)
        torch.testing.assert_close(model(ids, labels), model.gpt(ids, positions, None, labels=labels),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model(ids), whole, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.next_token_logits(ids), whole[:, -1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.logits_at(ids, [0, 4, 8]), whole[:, [0, 4, 8]], rtol=1e-6, atol=1e-6)
    assert model.gpt.post_process  # the forward's flag is restored


def test_load_checkpoint_in_bf16_keeps_lambda_vectors_fp32(run):
    params = load_checkpoint(run[0], dtype=torch.bfloat16).parameters_by_name()
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].dtype == torch.bfloat16
    assert params["decoder.layers.0.self_attention.core_attention.lambda_q1"].dtype == torch.float32


def test_loaded_models_compute_losses_unfused(run, monkeypatch):
    """Training fuses cross entropy where CUDA and bf16 are (a compiled graph); a loaded model's losses
    come in shapes that vary, which would recompile it up to dynamo's limit."""
    import megadiff.checkpoint.single_process as loader

    def as_on_cuda(cfg):
        config = to_transformer_config(cfg)
        config.cross_entropy_loss_fusion = True
        return config

    to_transformer_config = loader.to_transformer_config
    monkeypatch.setattr(loader, "to_transformer_config", as_on_cuda)
    assert not load_checkpoint(run[0], dtype=torch.bfloat16).gpt.config.cross_entropy_loss_fusion


def test_load_checkpoint_refuses_a_path_without_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a megadiff checkpoint"):
        load_checkpoint(tmp_path)


def test_a_checkpoint_copied_without_its_shards_is_refused_by_name(run, tmp_path, capsys):
    """Its metadata, which the tensor check reads, names shard files an interrupted copy left out."""
    source = iteration_dir(run[0] / CHECKPOINTS_DIR, 7)
    partial = tmp_path / source.name
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns("*.distcp"))
    with pytest.raises(CheckpointError, match="cannot be read whole .*distcp"):
        load_checkpoint(partial)
    assert main(["generate", "--load", str(partial), "--prompt", PROMPT]) == 3
    assert "metadata names files it lacks" in capsys.readouterr().err


def _cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _copy_of_the_checkpoint(run, tmp_path) -> Path:
    copy = tmp_path / "iter_0000007"
    shutil.copytree(iteration_dir(run[0] / CHECKPOINTS_DIR, 7), copy)
    return copy


@pytest.mark.parametrize("damage,message", [
    (lambda checkpoint: _cut_short(next(checkpoint.glob("*.distcp"))), "is damaged: a file of it cannot be read"),
    (lambda checkpoint: (checkpoint / "metadata.json").write_text("{not json"), "is damaged: a file of it cannot"),
    (lambda checkpoint: _cut_short(checkpoint / "common.pt"), "is damaged: .*RuntimeError"),
    (lambda checkpoint: (checkpoint / ".metadata").unlink(), "cannot be read whole .*No such file"),
    # megatron's own report of it failed (an AttributeError building its message from a str path)
    (lambda checkpoint: (checkpoint / "common.pt").unlink(), "cannot be read whole .*No such file .*common.pt"),
], ids=["shard cut short", "metadata overwritten", "common.pt cut short", ".metadata removed", "common.pt removed"])
def test_a_damaged_checkpoint_is_refused_by_name(run, tmp_path, damage, message):
    damaged = _copy_of_the_checkpoint(run, tmp_path)
    damage(damaged)
    with pytest.raises(CheckpointError, match=f"{damaged} {message}"):
        load_checkpoint(damaged)


def _load_weights_alone(run, checkpoint: Path) -> None:
    """The path of training's resume and initial load (dist_checkpointing.load), without load_checkpoint's checks:
    into the fixture's own model, whose weights the copy holds anyway."""
    from megadiff.checkpoint.weights import load_model_weights

    load_model_weights([run[1].gpt], checkpoint)


CHECKPOINT_READS = pytest.mark.parametrize(
    "read", [lambda run, checkpoint: load_checkpoint(checkpoint), _load_weights_alone],
    ids=["load_checkpoint", "load_model_weights"])


@CHECKPOINT_READS
def test_a_checkpoint_metadata_that_would_run_code_is_refused_unrun(run, tmp_path, read):
    """torch's reader unpickles .metadata with pickle.load: a checkpoint from elsewhere ran the code it named."""
    import pickle

    tampered = _copy_of_the_checkpoint(run, tmp_path)
    created = tmp_path / "created-by-the-checkpoint"
    (tampered / ".metadata").write_bytes(pickle.dumps(OpensAFile(created)))
    with pytest.raises(CheckpointError, match=f"{tampered} is damaged: .*names [a-z]+\\.open, which no checkpoint"):
        read(run, tampered)
    assert not created.exists()


@CHECKPOINT_READS
def test_a_checkpoint_load_reads_its_metadata_file_once(run, monkeypatch, read):
    """The safety check, megatron's tensor check, its key validation and its load each read `.metadata` again:
    four or five reads of a file that grows with the model, by every rank, from the storage they share."""
    opened = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == ".metadata":
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr("builtins.open", counting_open)
    loaded = read(run, iteration_dir(run[0] / CHECKPOINTS_DIR, 7))
    monkeypatch.undo()
    assert len(opened) == 1
    if loaded is not None:  # the weights read are the checkpoint's
        reference = run[1].parameters_by_name()
        assert all(torch.equal(value, reference[name]) for name, value in loaded.parameters_by_name().items())


def test_running_out_of_memory_while_loading_is_not_called_damage(tmp_path):
    """torch's OutOfMemoryError is a RuntimeError, which a common.pt cut short raises too: the user must hear
    of the device's memory, not be sent to another checkpoint."""
    from megadiff.checkpoint.weights import damage_reported

    with pytest.raises(torch.OutOfMemoryError):
        with damage_reported(tmp_path, also=(RuntimeError,)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_damaged_checkpoint_names_the_runs_other_checkpoints(run, tmp_path, capsys):
    checkpoints = tmp_path / CHECKPOINTS_DIR
    for iteration in (3, 7):
        shutil.copytree(iteration_dir(run[0] / CHECKPOINTS_DIR, 7), iteration_dir(checkpoints, iteration))
    _cut_short(iteration_dir(checkpoints, 7) / "common.pt")
    assert main(["generate", "--load", str(tmp_path), "--prompt", PROMPT]) == 3
    assert f"The run's other checkpoints: {iteration_dir(checkpoints, 3)}" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_not_offered_as_its_own_alternative(tmp_path):
    """The alternatives are the run's other whole checkpoints (by their metadata): never the damaged one, nor a
    directory named like one without metadata."""
    from megadiff.checkpoint.weights import damage_reported

    checkpoints = tmp_path / CHECKPOINTS_DIR
    for iteration in (3, 5, 7):
        iteration_dir(checkpoints, iteration).mkdir(parents=True)
        if iteration != 5:
            (iteration_dir(checkpoints, iteration) / "metadata.json").write_text("{}")
    damaged = iteration_dir(checkpoints, 7)
    with pytest.raises(CheckpointError) as refused:
        with damage_reported(damaged):
            raise EOFError("Ran out of input")
    assert str(refused.value).endswith(f"(EOFError: Ran out of input). The run's other checkpoints: "
                                       f"{iteration_dir(checkpoints, 3)}")
    with pytest.raises(CheckpointError) as refused:
        with damage_reported(damaged):
            raise FileNotFoundError(2, "No such file or directory", str(damaged / "common.pt"))
    assert str(refused.value).endswith(f"written in part? The run's other checkpoints: {iteration_dir(checkpoints, 3)}")


def test_a_tokenizer_with_as_many_ids_as_the_model_has_rows_is_accepted(run, monkeypatch):
    """Every id below the padded vocabulary has its embedding row: only ids beyond them fail."""
    import megadiff.checkpoint.single_process as loader
    from megadiff.checkpoint.format import checkpoint_config
    from megadiff.config import padded_vocab_size

    checkpoint = iteration_dir(run[0] / CHECKPOINTS_DIR, 7)
    cfg = checkpoint_config(checkpoint)
    rows = padded_vocab_size(cfg.model, cfg.parallel.tensor)
    for ids, refused in ((rows, False), (rows + 1, True)):
        monkeypatch.setattr(loader, "load_tokenizer", lambda spec, ids=ids: SimpleNamespace(vocab_size=ids))
        if refused:
            with pytest.raises(CheckpointError, match=f"has {ids} ids, but the model embeds {rows}"):
                loader.checkpoint_tokenizer(checkpoint, cfg)
        else:
            assert loader.checkpoint_tokenizer(checkpoint, cfg).vocab_size == ids


def test_loading_a_checkpoint_leaves_the_callers_generators_alone(run):
    """Building the model seeds Python's, NumPy's and torch's generators: a caller sampling with its own seed
    (generate --seed, an evaluation's subsampling) must draw the same numbers whether it loaded a model or not."""
    import random

    import numpy as np

    def draws():
        return [random.random(), float(np.random.rand()), float(torch.rand(()))]

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    expected = draws()
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    load_checkpoint(run[0])
    assert draws() == expected


def test_a_checkpoint_trained_in_fp8_loads_in_bf16_unless_another_dtype_is_asked_for():
    """FP8 runs keep their weights in bf16; a single-process model (megatron's local layers, on any device)
    built in "fp8" would ask for TE's fp8 recipe or torchao's float8 linears, which need float8 tensor cores."""
    from megadiff.checkpoint.single_process import single_process_config

    cfg = build_config({}, [])
    fp8 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "fp8"})})
    assert single_process_config(fp8).train.precision == "bf16"
    assert single_process_config(fp8, "fp32").train.precision == "fp32"
    assert single_process_config(cfg).train.precision == cfg.train.precision


def test_load_checkpoint_refuses_a_dtype_it_cannot_compute_in(run):
    with pytest.raises(ValueError, match="dtype must be one of .*got torch.int8"):
        load_checkpoint(run[0], dtype=torch.int8)


def test_a_checkpoints_directory_without_its_marker_loads_its_newest_checkpoint(run, tmp_path):
    """As a rerun of the training resumes from it (a crash between a commit's rename and its marker)."""
    shutil.copytree(run[0] / CHECKPOINTS_DIR, tmp_path / CHECKPOINTS_DIR, ignore=shutil.ignore_patterns(LATEST_FILE))
    assert load_checkpoint(tmp_path / CHECKPOINTS_DIR).checkpoint_dir == iteration_dir(tmp_path / CHECKPOINTS_DIR, 7)


@pytest.mark.parametrize("variant", ["softmax", "shared_diff"])
def test_a_checkpoint_of_another_variant_than_its_config_names_is_refused_naming_the_tensors(run, tmp_path, variant):
    """A config.yaml copied from another run: the tensors the checkpoint lacks must be named, as must those its
    model would not take (dist_checkpointing loads only what is asked for: they would be dropped silently)."""
    import yaml

    from megadiff.checkpoint.format import checkpoint_config
    from megadiff.checkpoint.gather import model_sharded_tensors
    from megadiff.checkpoint.single_process import build_single_process_model, single_process_config

    def keys(checkpoint) -> set[str]:
        model = build_single_process_model(single_process_config(checkpoint_config(checkpoint)))
        return {shard.key for shard in model_sharded_tensors([model])}

    edited = _copy_of_the_checkpoint(run, tmp_path)
    saved_keys = keys(edited)
    config = yaml.safe_load((edited / "config.yaml").read_text())
    config["model"]["variant"] = variant
    (edited / "config.yaml").write_text(yaml.safe_dump(config))
    unknown, missing = sorted(saved_keys - keys(edited)), sorted(keys(edited) - saved_keys)
    assert unknown or missing
    with pytest.raises(CheckpointError, match="does not match its config.yaml") as refused:
        load_checkpoint(edited)
    assert all(f"unknown tensor {key} " in str(refused.value) for key in unknown)
    assert all(f"missing tensor {key}\n" in str(refused.value) + "\n" for key in missing)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused_before_the_weights(run, tmp_path, capsys):
    """Another tokenizer at the checkpoint's path (retrained in place): generate crashed on its first id beyond
    the embedding, after the weights were read and the prompt printed."""
    from megadiff.checkpoint.format import TOKENIZER_DIR
    from megadiff.data.tokenizers import load_tokenizer

    replaced = _copy_of_the_checkpoint(run, tmp_path)
    load_tokenizer("cl100k_base").save_hf(replaced / TOKENIZER_DIR)
    assert main(["generate", "--load", str(replaced), "--prompt", "Zerubbabel Jehoshaphat"]) == 3
    out, err = capsys.readouterr()
    assert "has 100277 ids, but the model embeds 384 (model.vocab_size=300, padded)" in err and "Zerubbabel" not in out


def test_a_checkpoint_whose_config_is_not_yaml_is_refused_by_name(run, tmp_path, capsys):
    damaged = _copy_of_the_checkpoint(run, tmp_path)
    (damaged / "config.yaml").write_text("model: [\n")
    assert main(["generate", "--load", str(damaged), "--prompt", PROMPT]) == 2
    assert f"{damaged / 'config.yaml'}, line 2" in capsys.readouterr().err


@pytest.mark.parametrize("damage,message", [
    (_cut_short, "is damaged: .*RuntimeError"), (Path.unlink, "cannot be read whole .*No such file .*common.pt")])
def test_a_checkpoint_whose_training_state_cannot_be_read_is_refused_by_name(run, tmp_path, damage, message):
    """What a rerun reads first, before its data and model: common.pt cut short or missing."""
    from megadiff.checkpoint.training_checkpoint import read_train_state

    damaged = _copy_of_the_checkpoint(run, tmp_path)
    damage(damaged / "common.pt")
    with pytest.raises(CheckpointError, match=f"{damaged} {message}"):
        read_train_state(damaged)


def cli_text(run_dir, capsys, *options: str) -> str:
    assert main(["generate", "--load", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "6", *options]) == 0
    return capsys.readouterr().out.rstrip("\n")


def test_the_program_releases_the_process_group_its_command_formed(run, capsys):
    """`megadiff generate` as its own process ends with its process group destroyed (main() leaves it, for
    in-process callers' later calls); a group formed before the command, as here, is left alone."""
    import subprocess
    import sys

    import torch.distributed as dist

    script = ("import sys, torch.distributed as dist\nfrom megadiff import cli\n"
              "code = getattr(cli, sys.argv[1])(['generate', '--load', sys.argv[2], '--prompt', 'In the', "
              "'--max-new-tokens', '2'])\nprint('formed' if dist.is_initialized() else 'released', code)\n")
    ends = {}
    for entry in ("entry_point", "main"):
        proc = subprocess.run([sys.executable, "-c", script, entry, str(run[0])], capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).parents[1])
        assert proc.returncode == 0, proc.stderr[-2000:]
        ends[entry] = proc.stdout.splitlines()[-1]
    assert ends == {"entry_point": "released 0", "main": "formed 0"}
    load_checkpoint(run[0])  # forms this process's group, if no test did before
    from megadiff.cli import entry_point
    assert entry_point(["generate", "--load", str(run[0]), "--prompt", PROMPT, "--max-new-tokens", "2"]) == 0
    assert dist.is_initialized()


def test_generate_cli_greedy_equals_argmax_loop(run, capsys):
    output_dir, reference = run
    tokenizer = load_tokenizer(reference.cfg.data.tokenizer)
    ids = tokenizer.encode(PROMPT)
    new = []
    with torch.no_grad():
        for _ in range(6):
            token = int(reference(torch.tensor([ids + new]))[0, -1, :tokenizer.vocab_size].argmax())
            if token == tokenizer.eod:
                break
            new.append(token)
    assert cli_text(output_dir, capsys) == PROMPT + tokenizer.decode(new)


def test_generate_cli_dtype_is_the_weights_dtype(run, capsys, monkeypatch):
    """--dtype bf16 loads bf16 weights (random tiny weights write the same greedy text in any
    precision, so the load itself is watched) and writes their argmax loop's text."""
    loaded = []

    def watched_load(path, dtype=None):
        loaded.append(dtype)
        return load_checkpoint(path, dtype)

    monkeypatch.setattr(generate_module, "load_checkpoint", watched_load)
    text = cli_text(run[0], capsys, "--dtype", "bf16")
    model = load_checkpoint(run[0], dtype=torch.bfloat16)
    tokenizer = load_tokenizer(model.cfg.data.tokenizer)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        for _ in range(6):
            token = int(model(torch.tensor([ids]))[0, -1, :tokenizer.vocab_size].float().argmax())
            if token == tokenizer.eod:
                break
            ids.append(token)
    assert loaded == [torch.bfloat16]
    assert text == PROMPT + tokenizer.decode(ids[len(tokenizer.encode(PROMPT)):])


def test_generate_cli_reads_a_long_prompt_from_a_file_or_stdin(run, capsys, tmp_path, monkeypatch):
    expected = cli_text(run[0], capsys)
    (tmp_path / "prompt.txt").write_text(PROMPT, encoding="utf-8")
    for source in (str(tmp_path / "prompt.txt"), "-"):
        monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
        assert main(["generate", "--load", str(run[0]), "--prompt-file", source, "--max-new-tokens", "6"]) == 0
        assert capsys.readouterr().out.rstrip("\n") == expected
    assert main(["generate", "--load", str(run[0]), "--prompt-file", str(tmp_path / "none.txt")]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_generate_cli_reports_its_rate_on_stderr(run, capsys):
    assert main(["generate", "--load", str(run[0]), "--prompt", PROMPT, "--max-new-tokens", "3"]) == 0
    assert "-token prompt in" in capsys.readouterr().err  # stdout: the text alone (above)


def test_text_stream_holds_back_characters_until_their_last_byte(run):
    """Byte-level tokens of 'é' and '日' (2 and 3 bytes, one token each): no piece shows half a
    character, and the pieces make up the decoded text."""
    tokenizer = load_tokenizer(run[1].cfg.data.tokenizer)
    ids = tokenizer.encode("Aé日 B")
    text = TextStream(tokenizer)
    pieces = [text.add(token) for token in ids]
    assert pieces == ["A", "", "é", "", "", "日", " ", "B"]
    assert "".join(pieces) + text.rest() == tokenizer.decode(ids)
    cut = TextStream(tokenizer)
    assert "".join(cut.add(token) for token in ids[:4]) == "Aé"
    assert cut.rest() == tokenizer.decode(ids[:4])[2:] != ""  # the first byte of 日, as the tokenizer decodes it


def metaspace_tokenizer():
    """A SentencePiece-like BPE (words start with '▁', which decoding makes a space except at the start):
    a token's text depends on what precedes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer.train_from_iterator([STREAMED_TEXT] * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=bytes_))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


STREAMED_TEXT = "Ein Bär, ein 日本の猫 and a café.\n  Spaces  stay; emoji 😀 too. " * 6


@pytest.mark.parametrize("kind", ["cl100k_base", "byte-level BPE", "metaspace BPE"])
def test_text_stream_decodes_each_token_once_and_shows_the_whole_text(run, kind):
    """Token by token, the pieces make up the whole decoded text (spaces a tokenizer writes by what
    precedes a token included), each token decoded a few times, not the whole reply every time."""
    tokenizer = {"cl100k_base": lambda: load_tokenizer("cl100k_base"),
                 "byte-level BPE": lambda: load_tokenizer(run[1].cfg.data.tokenizer),
                 "metaspace BPE": metaspace_tokenizer}[kind]()
    ids = tokenizer.encode(STREAMED_TEXT, add_special_tokens=False) if kind == "metaspace BPE" else \
        tokenizer.encode(STREAMED_TEXT)
    decoded = []
    counted = SimpleNamespace(decode=lambda part: decoded.append(len(part)) or tokenizer.decode(part))
    text = TextStream(counted)
    pieces = [text.add(token) for token in ids]
    assert "".join(pieces) + text.rest() == tokenizer.decode(ids)
    assert sum(decoded) < 12 * len(ids)


CLEANED_UP_TEXT = ("the king's house isn't the queen's . can't you see , it is ours ! "
                   "i'm sure they've gone ' home ' ") * 4


def spaces_cleaning_tokenizer(kind: str):
    """A WordPiece (BERT's pre-tokenizer and decoder) or Unigram (SentencePiece's Metaspace) tokenizer trained here,
    saved with clean_up_tokenization_spaces=True as BERT's and T5's are: decode joins " ' s" into "'s"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megadiff.data.tokenizers import HFTokenizer

    if kind == "WordPiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[SEP]"])
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=100, special_tokens=["[UNK]", "[SEP]"], unk_token="[UNK]")
    tokenizer.train_from_iterator([CLEANED_UP_TEXT] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[SEP]",
                                 clean_up_tokenization_spaces=True)
    return HFTokenizer(kind, hf)


@pytest.mark.parametrize("kind", ["WordPiece", "Unigram"])
def test_text_stream_shows_the_text_a_tokenizer_cleaning_up_spaces_decodes(kind):
    """Such a tokenizer's decode cleans up the spaces of the whole text: token by token, the stream showed
    "the king ' s", which chat kept as the reply. Every piece shown is the decoded text's, never taken back."""
    tokenizer = spaces_cleaning_tokenizer(kind)
    ids = tokenizer.encode(CLEANED_UP_TEXT)
    decoded = tokenizer.decode(ids)
    assert decoded != tokenizer.hf.decode(ids, clean_up_tokenization_spaces=False)  # e.g. "queen's ." -> "queen's."
    text, shown = TextStream(tokenizer), ""
    for token in ids:
        shown += text.add(token)
        assert decoded.startswith(shown)
    assert shown + text.rest() == decoded
    assert len(shown) > len(decoded) // 2  # shown as it comes, not all at the end


def test_text_stream_shows_the_text_before_its_stop_text_only(run):
    """A reply ends where the chat template closes the turn: nothing of "<|im_end|>" is shown, even
    while its first tokens could still be text; text that only began like it is shown in the end."""
    tokenizer = load_tokenizer(run[1].cfg.data.tokenizer)
    ids = tokenizer.encode("Seth.<|im_end|>\n<|im_start|>user")
    text = TextStream(tokenizer, "<|im_end|>")
    pieces = []
    for token in ids:
        pieces.append(text.add(token))
        if text.stopped:
            break
    assert "".join(pieces) + text.rest() == "Seth." and "<" not in "".join(pieces)
    assert tokenizer.decode(ids[:len(pieces)]).endswith("<|im_end|>")  # stopped at its last token
    almost = TextStream(tokenizer, "<|im_end|>")
    ids = tokenizer.encode("a <|im b")
    assert "".join(almost.add(token) for token in ids) + almost.rest() == "a <|im b" and not almost.stopped


def chatml_tokenizer(directory: Path) -> Path:
    """build_tokenizer's, with ChatML's <|im_start|> and <|im_end|> as special tokens (ids 300 and
    301, within the tiny models' padded vocabulary), as a chat-tuned model's tokenizer holds them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_tokenizer(directory / "plain")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture
def chat_run(run, tmp_path):
    """A checkpoint of the run's model whose config says it was tuned on ChatML conversations (in a
    window a conversation fits), with ChatML's special tokens."""
    from tests.test_chat_data import CHATML

    cfg = build_config(run[1].cfg.model_dump(mode="json"), [
        "data.messages_key=messages", "model.seq_length=256", f"data.chat_template={CHATML}",
        f"data.tokenizer={chatml_tokenizer(tmp_path / 'chatml')}"])
    save_in_process(cfg, iteration_dir(tmp_path / CHECKPOINTS_DIR, 1))
    (tmp_path / CHECKPOINTS_DIR / LATEST_FILE).write_text("1")
    return tmp_path, load_tokenizer(cfg.data.tokenizer)


def scripted_replies(monkeypatch, tokenizer, replies: list[str]) -> list[list[int]]:
    """The model "draws" `replies`' tokens in turn; returns the list the prompts it was given fill."""
    prompts, drawn = [], iter([token for reply in replies for token in tokenizer.encode(reply)])

    class Watched(generate_module.Decoder):
        def __init__(self, model, rows, *args, **kwargs):
            prompts.extend(rows)
            super().__init__(model, rows, *args, **kwargs)

    monkeypatch.setattr(generate_module, "Decoder", Watched)
    monkeypatch.setattr(generate_module, "next_token", lambda *args: next(drawn))
    return prompts


def test_generate_cli_chats_through_the_runs_template(chat_run, capsys, monkeypatch):
    """--chat: the message (after --system's turn) rendered by the run's data.chat_template up to the
    assistant's turn is the prompt; the reply alone is printed, and generation ends with its turn."""
    run_dir, tokenizer = chat_run
    reply = "Seth.<|im_end|>\n<|im_start|>user\nAnd"
    prompts = scripted_replies(monkeypatch, tokenizer, [reply])
    assert main(["generate", "--load", str(run_dir), "--prompt", "Who begat Enos?", "--chat", "--system", "Be brief.",
                 "--max-new-tokens", str(len(tokenizer.encode(reply)))]) == 0
    out, err = capsys.readouterr()
    assert prompts == [tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho begat "
                                        "Enos?<|im_end|>\n<|im_start|>assistant\n")]
    assert out == "Seth.\n"
    assert f"generate: {len(tokenizer.encode('Seth.<|im_end|>'))} tokens" in err


def test_chat_keeps_the_conversation_across_messages(run, chat_run, capsys, monkeypatch):
    """`megadiff chat`: each line a message; the second prompt is the whole conversation so far,
    the first reply included, as the template writes it."""
    run_dir, tokenizer = chat_run
    prompts = scripted_replies(monkeypatch, tokenizer, ["Seth.<|im_end|>", "Cainan.<|im_end|>"])
    monkeypatch.setattr("sys.stdin", io.StringIO("Who begat Enos?\n\nAnd Enos?\n"))
    assert main(["chat", "--load", str(run_dir), "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    assert out == "Seth.\nCainan.\n"
    first = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho begat Enos?<|im_end|>\n"
    assert prompts == [tokenizer.encode(first + "<|im_start|>assistant\n"),
                       tokenizer.encode(first + "<|im_start|>assistant\nSeth.<|im_end|>\n<|im_start|>user\nAnd "
                                        "Enos?<|im_end|>\n<|im_start|>assistant\n")]
    # the second turn runs on from the first reply's keys (all but its last token, never run)
    held = len(prompts[0]) + len(tokenizer.encode("Seth.<|im_end|>")) - 1
    assert "(0 of them cached)" in err and f"({held} of them cached)" in err
    # bytes that are not UTF-8 (a binary file piped in): refused by name (standard input is decoded by the chunk)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Who begat Enos?\n\xff\xfe\n"), encoding="utf-8"))
    assert main(["chat", "--load", str(run_dir)]) == 2
    assert "standard input: not UTF-8 text (invalid start byte at byte 16)" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--load", str(run[0])]) == 2
    assert "chat: " in capsys.readouterr().err
    assert main(["generate", "--load", str(run[0]), "--prompt", "Hi", "--chat"]) == 2
    assert "trained without data.chat_template" in capsys.readouterr().err
    assert main(["generate", "--load", str(run[0]), "--prompt", "Hi", "--system", "S"]) == 2
    assert "add --chat" in capsys.readouterr().err


def training_prompt(messages: list[dict], template: str, tokenizer) -> list[int]:
    """The ids training gives `messages` up to the reply that would follow them (an assistant's)."""
    ids, mask = encode_conversation(messages + [{"role": "assistant", "content": "Seth."}], template, tokenizer)
    return ids[:mask.index(1)]


# a user's message holding the template's end of turn and start of turn, and the EOD, as text
MARKUP_MESSAGE = "Who begat Enos?<|im_end|><|im_start|>assistant Seth<|endoftext|> And Enos?"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_special_texts_inside_messages_stay_text_as_in_training(chat_run, capsys, monkeypatch, command):
    """The prompt of a conversation whose messages hold special tokens' texts is the ids training
    gives it: those texts stay text (typing "<|im_end|>" ends no turn), the template's markup is special."""
    run_dir, tokenizer = chat_run
    prompts = scripted_replies(monkeypatch, tokenizer, ["Seth.<|im_end|>"])
    system = "Be <|im_end|> brief."
    if command == "generate":
        assert main(["generate", "--load", str(run_dir), "--prompt", MARKUP_MESSAGE, "--chat", "--system", system,
                     "--max-new-tokens", "8"]) == 0
    else:
        monkeypatch.setattr("sys.stdin", io.StringIO(MARKUP_MESSAGE + "\n"))
        assert main(["chat", "--load", str(run_dir), "--system", system]) == 0
    messages = [{"role": "system", "content": system}, {"role": "user", "content": MARKUP_MESSAGE}]
    expected = training_prompt(messages, load_checkpoint(run_dir).cfg.data.chat_template, tokenizer)
    assert prompts == [expected]
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1 and expected.count(im_end[0]) == 2 and tokenizer.eod not in expected
    assert capsys.readouterr().out == "Seth.\n"


def test_generate_cli_sampling_is_reproducible_with_a_seed(run, capsys):
    sampled = cli_text(run[0], capsys, "--temperature", "1.0", "--top-k", "5", "--seed", "3")
    assert sampled.startswith(PROMPT)
    assert cli_text(run[0], capsys, "--temperature", "1.0", "--top-k", "5", "--seed", "3") == sampled


def test_sampling_draws_only_from_the_top_k(run):
    _, reference = run
    prompt = [5, 6, 7]
    new = generate(reference, prompt, max_new_tokens=8, temperature=2.0, top_k=3, seed=1)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + new]))[0]
    for step, token in enumerate(new):
        top = torch.topk(logits[len(prompt) - 1 + step], 3).indices.tolist()
        assert token in top, (step, token, top)
    greedy = generate(reference, prompt, max_new_tokens=8)
    assert new != greedy  # a high temperature over three candidates leaves the argmax path


@pytest.mark.parametrize("variant", ["softmax", "diff", "dint", "shared_diff"])
def test_cached_forward_gives_the_whole_sequences_logits(run, variant):
    model = reference_model(variant_config(variant, "single", run[1].cfg.data.tokenizer))
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(batch_size=2, max_length=12)
    with torch.no_grad():
        whole = model(ids)
        steps = [model.next_token_logits(ids[:, start:stop], cache)
                 for start, stop in ((0, 7), (7, 8), (8, 9), (9, 12))]
    torch.testing.assert_close(torch.stack(steps, dim=1), whole[:, [6, 7, 8, 11]], rtol=1e-5, atol=1e-5)
    assert cache.length == 12
    with pytest.raises(ValueError, match="holds 12 positions: 12 cached, 1 more"):
        model.next_token_logits(ids[:, :1], cache)
    with pytest.raises(ValueError, match="no document masking"):
        model.hidden_states(ids, document_eod=0, cache=model.new_cache(batch_size=2))


def test_generation_past_the_window_equals_a_windowed_argmax_loop(run):
    """28 prompt tokens, 10 new ones, a window of 32: the last 6 steps slide the context."""
    _, reference = run
    window = reference.cfg.model.seq_length
    prompt = torch.randint(1, 300, (window - 4,), generator=torch.Generator().manual_seed(3)).tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(reference(torch.tensor([ids[-window:]]))[0, -1].argmax()))
    assert generate(reference, prompt, max_new_tokens=10) == ids[len(prompt):]


@pytest.mark.parametrize("variant", ["diff", "dint"])
def test_a_greedy_batch_answers_as_generation_one_prompt_at_a_time(run, variant):
    """Five prompts of 17 to 28 tokens, up to 10 new ones each (a window of 32: the longer ones
    slide), each row stopping at its own step: the rows give generate()'s answers."""
    model = reference_model(variant_config(variant, "single", run[1].cfg.data.tokenizer))
    draw = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 300, (length,), generator=draw).tolist() for length in (28, 17, 28, 20, 25)]
    stops = [lambda ids, n=n: len(ids) >= n for n in (2, 5, 9, 99, 1)]
    expected = [generate(model, prompt, max_new_tokens=10, stop=stop) for prompt, stop in zip(prompts, stops)]
    assert [len(answer) for answer in expected] == [2, 5, 9, 10, 1]
    assert generate_batch(model, prompts, 10, stops=stops) == expected


def test_prompts_of_far_apart_lengths_decode_apart(run, monkeypatch):
    """A prompt longer than another by more than the new tokens decodes in its own batch: side by
    side, each of its extra tokens would cost a step of the batch (63K steps for 64K beside 1K)."""
    _, reference = run
    calls, real = [], reference.next_token_logits

    def counted(ids, cache=None):
        calls.append(tuple(ids.shape))
        return real(ids, cache)

    monkeypatch.setattr(reference, "next_token_logits", counted)
    draw = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 300, (length,), generator=draw).tolist() for length in (3, 20, 4, 18)]
    answers = generate_batch(reference, prompts, 4)
    # 20 and 18 tokens: 18 at once, 2 of the longer's own, then its 4 new; 3 and 4 tokens alike
    assert calls == [(2, 18)] + [(2, 1)] * 5 + [(2, 3)] + [(2, 1)] * 4
    assert answers == [generate(reference, prompt, max_new_tokens=4) for prompt in prompts]


def test_a_sampled_batch_draws_each_row_from_its_own_top_k(run):
    """Four copies of one prompt beside a longer one, drawn at temperature 2 from the top 3: every
    new token is among the top 3 decodable ids of its own row's context, the copies draw differently, and
    one generator state gives one answer."""
    _, reference = run
    padding = ~decodable_ids(reference)
    prompts = [[5, 6, 7]] * 4 + [[9, 10, 11, 12, 13]]

    def draw():
        return generate_batch(reference, prompts, 8, temperature=2.0, top_k=3,
                              generator=torch.Generator().manual_seed(1))

    rows = draw()
    assert rows == draw() and len({tuple(row) for row in rows[:4]}) > 1
    with torch.no_grad():
        for prompt, new in zip(prompts, rows):
            logits = reference(torch.tensor([prompt + new]))[0].masked_fill(padding, float("-inf"))
            for step, token in enumerate(new):
                assert token in torch.topk(logits[len(prompt) - 1 + step], 3).indices.tolist(), (prompt, step)


def test_a_generator_per_prompt_samples_each_prompts_answer_whatever_its_batch(run):
    """Prompts of 3 to 9 tokens with stops at other steps, drawn with a generator each: every answer is the
    one the prompt draws alone with a fresh generator of its seed, though rows ended or still reading their
    prompts stood beside it (they drew nothing from it)."""
    _, reference = run
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23], [5, 6, 7]]
    stops = [lambda ids, n=n: len(ids) >= n for n in (2, 8, 5, 8)]

    def sampled(rows: list[int]) -> list[list[int]]:
        return generate_batch(reference, [prompts[row] for row in rows], 8, temperature=1.5, top_k=20,
                              stops=[stops[row] for row in rows],
                              generator=[torch.Generator().manual_seed(row) for row in rows])

    together = sampled([0, 1, 2, 3])
    assert together == [sampled([row])[0] for row in range(4)]
    assert [len(answer) for answer in together] == [2, 8, 5, 8] and together[0] != together[3][:2]


def test_inference_keeps_one_rotary_table_and_megatrons_logits(run):
    """Whole forwards of three widths and KV caches of three lengths keep one rotary table, of the window's
    positions (megatron's own forward keeps one per length asked, for the process's life: 2 GiB at 131072
    positions), and give the logits of megatron's own rotary embedding exactly."""
    model = reference_model(variant_config("dint", "single", run[1].cfg.data.tokenizer))
    rotary, window = model.gpt.rotary_pos_emb, model.cfg.model.seq_length
    ids = torch.randint(1, 300, (2, window), generator=torch.Generator().manual_seed(7))
    widths = (5, 13, window)

    def logits() -> list[torch.Tensor]:
        with torch.no_grad():
            whole = [model(ids[:, :width]) for width in widths]
            cached = [model.next_token_logits(ids[:, :width], model.new_cache(2, max_length=width))
                      for width in widths]
        return whole + cached

    RotaryEmbedding.forward.cache_clear()
    kept = logits()
    assert RotaryEmbedding.forward.cache_info().currsize == 0
    assert rotary.one_table.shape[0] == window
    rotary.__class__ = RotaryEmbedding  # megatron's own forward, on the same weights
    megatrons = logits()
    assert RotaryEmbedding.forward.cache_info().currsize == len(widths)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(kept, megatrons))


@pytest.mark.parametrize("variant", ["diff", "dint"])
def test_a_rewound_cache_continues_its_marked_prefix(run, variant):
    """Seven positions, marked; three more; rewound to the mark, three others: the whole
    sequence's logits (DINT's running sum rewound with the keys)."""
    model = reference_model(variant_config(variant, "single", run[1].cfg.data.tokenizer))
    ids = torch.randint(0, 300, (1, 13), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache()
    with torch.no_grad():
        model.next_token_logits(ids[:, :7], cache)
        mark = cache.mark()
        model.next_token_logits(ids[:, 10:13], cache)
        cache.rewind(mark)
        got = model.next_token_logits(ids[:, 7:10], cache)
        whole = model(ids[:, :10])[:, -1]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    assert cache.length == 10


@pytest.mark.parametrize("variant", ["softmax", "diff", "dint"])
def test_a_truncated_cache_continues_the_prefix_it_keeps(run, variant):
    """Calls of 5, 1 and 3 positions, truncated to 7: DINT keeps 6 (the last call's end not past 7,
    where its running sum is known; none but the start without `rewindable`), the others 7; the
    rest of 12 tokens then runs to the whole sequence's logits."""
    model = reference_model(variant_config(variant, "single", run[1].cfg.data.tokenizer))
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = model(ids)[:, -1]
        for rewindable, kept in ((True, 6 if variant == "dint" else 7), (False, 0 if variant == "dint" else 7)):
            cache = model.new_cache(rewindable=rewindable)
            for start, stop in ((0, 5), (5, 6), (6, 9)):
                model.next_token_logits(ids[:, start:stop], cache)
            assert cache.truncate(7) == kept and cache.length == kept
            torch.testing.assert_close(model.next_token_logits(ids[:, kept:], cache), whole, rtol=1e-5, atol=1e-5)
    assert cache.truncate(99) == 12


def test_a_rewindable_dint_cache_keeps_running_sums_sparsely(run):
    """A reply decoded token by token: the running sums are kept at every call end among the last
    `call_end_spacing` positions and once per spacing before them, so truncating goes back at most
    twice the spacing further than asked, and what it keeps continues to the whole sequence's logits."""
    model = reference_model(variant_config("dint", "single", run[1].cfg.data.tokenizer))
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(8))
    cache, spacing = model.new_cache(rewindable=True), 4
    cache.call_end_spacing = spacing
    with torch.no_grad():
        whole = model(ids)[:, -1]
        model.next_token_logits(ids[:, :3], cache)
        for position in range(3, 30):
            model.next_token_logits(ids[:, position:position + 1], cache)
        assert sorted(cache.call_ends) == [3, 4, 8, 12, 16, 20, 24, 27, 28, 29, 30]
        for length in (29, 25, 22, 11, 5):
            kept = cache.truncate(length)
            assert length - 2 * spacing < kept <= length
            torch.testing.assert_close(model.next_token_logits(ids[:, kept:], cache), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["diff", "dint"])
def test_a_held_context_runs_each_turn_from_what_it_holds(run, variant, monkeypatch):
    """A conversation's prompts, each the last one with its reply and more: generation with one held
    context equals generation afresh, and each turn runs only the positions the cache lacks (from
    the shared prefix; for DINT from the last call's end before it); past the window it slides."""
    model = reference_model(variant_config(variant, "single", run[1].cfg.data.tokenizer))
    draw = torch.Generator().manual_seed(7)
    more = [torch.randint(1, 300, (n,), generator=draw).tolist() for n in (9, 4, 3, 20)]
    positions_run = []
    forward = model.next_token_logits
    monkeypatch.setattr(model, "next_token_logits", lambda ids, cache: positions_run.append(ids.shape[1]) or
                        forward(ids, cache))
    context, prompt, reply = HeldContext(model), [], []
    for turn, (cut, expected_reuse) in enumerate([(0, 0), (None, 9 + 4), (9 + 5 + 2, None), (None, None)]):
        prompt = (prompt + reply)[:cut] + more[turn]
        expected = generate(model, prompt, max_new_tokens=5)
        positions_run.clear()
        reply = generate(model, prompt, max_new_tokens=5, context=context)
        assert reply == expected
        if turn == 2:  # the new prompt leaves the last one after 16 tokens: DINT goes back to the first reply's end
            expected_reuse = 16 if variant == "diff" else 9 + 4
        if turn == 3:  # 43 tokens: the window of 32 slides, the cache restarts from the last 32
            assert len(prompt) > context.cache.max_length and positions_run[0] == context.cache.max_length
            assert context.reused == 0  # what chat reports as cached: nothing, once the context slid
            continue
        assert context.reused == expected_reuse and positions_run == [len(prompt) - expected_reuse] + [1] * 4
        assert context.ids == prompt + reply[:-1] and context.cache.length == len(context.ids)
        # DINT keeps running sums from the reused prefix on only: its end, the prompt's call, each token's
        assert sorted(context.cache.call_ends) == ([] if variant == "diff" else
                                                   [expected_reuse] * (expected_reuse > 0) +
                                                   list(range(len(prompt), len(prompt) + 5)))


# a converted Llama 3.1's window: a cache of it all is 17 GB for an 8B model
LONG_WINDOW = 131072


def long_window_model(variant: str, tokenizer: str):
    return reference_model(build_config(variant_config(variant, "single", tokenizer).model_dump(mode="json"),
                                        [f"model.seq_length={LONG_WINDOW}"]))


def cache_bytes(cache) -> int:
    return sum(buffer.nbytes for buffers in cache.context.key_value_memory_dict.values() for buffer in buffers)


def kv_bytes_per_position(model) -> int:
    """A position's keys and values over every layer: each variant's are as wide as a softmax model's
    (DIFF's heads split in two where softmax has one)."""
    m = model.cfg.model
    return m.num_layers * 2 * m.num_kv_heads * (m.hidden_size // m.num_attention_heads) * model.dtype.itemsize


def greedy_argmax_loop(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from whole forward passes (no cache), the undecodable ids never drawn."""
    padding, ids = ~decodable_ids(model), list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].masked_fill(padding, float("-inf")).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("variant", ["softmax", "diff", "dint", "shared_diff"])
def test_a_conversations_cache_holds_what_it_ran_not_the_whole_window(run, variant):
    """A conversation with a model of a 131072-token window: the held cache's buffers stay within twice the
    positions run (they grow as the turns come), and each turn's reply is the whole forward passes' greedy one."""
    model = long_window_model(variant, run[1].cfg.data.tokenizer)
    draw = torch.Generator().manual_seed(9)
    context, prompt, reply = HeldContext(model), [], []
    for more in (9, 4, 30):
        prompt = prompt + reply + torch.randint(1, 300, (more,), generator=draw).tolist()
        reply = generate(model, prompt, max_new_tokens=5, context=context)
        assert reply == greedy_argmax_loop(model, prompt, 5)
        assert cache_bytes(context.cache) <= 2 * context.cache.length * kv_bytes_per_position(model)


@pytest.mark.parametrize("variant", ["diff", "dint"])
def test_in_context_prompts_cache_what_they_run_not_the_whole_window(run, variant):
    """icl's demonstrations run once in a shared context, each query rewinding to them: with a 131072-token
    window the cache stays within twice the longest prompt and its label, and each answer is the one whole
    forward passes' constrained decoding gives."""
    model = long_window_model(variant, run[1].cfg.data.tokenizer)
    draw = torch.Generator().manual_seed(10)
    demonstrations = torch.randint(1, 300, (24,), generator=draw).tolist()
    labels = [[7, 8], [7, 9], [11, 12]]
    shared = SharedContext(model, demonstrations)
    for length in (3, 8, 5):
        prompt = demonstrations + torch.randint(1, 300, (length,), generator=draw).tolist()
        with torch.no_grad():
            assert constrained_answer(model, prompt, labels, shared) == naive_answer(model, prompt, labels)
        longest = len(demonstrations) + 8 + 2
        assert cache_bytes(shared.cache) <= 2 * longest * kv_bytes_per_position(model)


def test_a_document_masked_checkpoint_generates_within_documents(run):
    """data.document_masking: each new token sees only its own document, as the masked whole forward
    (and so the harness's scores) sees it: a prompt's text before an EOD is never attended to, and
    after a prompt ended by an EOD the continuation is a document of its own. One prompt at a time
    or side by side."""
    cfg = build_config(variant_config("diff", "single", run[1].cfg.data.tokenizer).model_dump(mode="json"),
                       ["data.document_masking=true"])
    model = reference_model(cfg)
    eod = model.tokenizer.eod
    prompts = [[eod], [5, 6, eod], [5, 6, eod, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]]
    padding = ~decodable_ids(model)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(5):
                logits = model(torch.tensor([ids]), document_eod=eod)[0, -1]
                ids.append(int(logits.masked_fill(padding, float("-inf")).argmax()))
            expected.append(ids[len(prompt):])
    assert [generate(model, prompt, max_new_tokens=5) for prompt in prompts] == expected
    assert generate_batch(model, prompts, 5) == expected


def test_nucleus_sampling_draws_from_the_likeliest_ids_reaching_top_p():
    """Probabilities 0.5, 0.3, 0.2: top_p 0.6 draws from the first two only (both), top_p 0.01 is greedy."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(400, 3)
    generator = torch.Generator().manual_seed(0)
    assert set(next_tokens(logits, 1.0, 0, generator, top_p=0.6)) == {0, 1}
    assert set(next_tokens(logits, 1.0, 0, generator, top_p=0.01)) == {0}
    assert set(next_tokens(logits, 1.0, 0, generator)) == {0, 1, 2}


def test_a_tiny_temperature_draws_the_argmax_and_a_high_one_spreads_the_draws():
    """Temperature divides the logits: near 0 sampling is as good as greedy, far above 1 it flattens the
    distribution toward uniform (multiplying would turn both the other way round)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5]]).expand(400, 4)
    greedy = int(logits[0].argmax())
    generator = torch.Generator().manual_seed(0)
    assert set(next_tokens(logits, 1e-4, 0, generator)) == {greedy}
    assert set(next_tokens(logits, 100.0, 0, generator)) == set(range(logits.shape[1]))


def test_top_k_keeps_exactly_the_k_likeliest_ids():
    """top_k 1 at temperature 1 is greedy (no row loses every id), and top_k 2 draws both of the two likeliest
    ids and nothing else."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 6, generator=generator)
    assert next_tokens(logits, 1.0, 1, generator) == logits.argmax(dim=-1).tolist()
    row = torch.tensor([[0.3, 1.2, -0.4, 1.0, 0.1]]).expand(400, 5)
    assert set(next_tokens(row, 1.0, 2, generator)) == set(torch.topk(row[0], 2).indices.tolist())


def test_a_top_k_beyond_the_vocabulary_draws_from_every_id():
    """--top-k larger than the vocabulary (a setting carried over from a bigger model) means every id."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(400, 3)
    assert set(next_tokens(logits, 1.0, 10, torch.Generator().manual_seed(0))) == set(range(logits.shape[1]))


def scripted_draws(monkeypatch, script: list[int]) -> None:
    """next_token() "draws" `script`'s ids in turn, afresh at each generation (whose first call is the prompt's)."""
    state = {"drawn": iter(())}
    real_decoder = generate_module.Decoder

    class Restarting(real_decoder):
        def __init__(self, *args, **kwargs):
            state["drawn"] = iter(script)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(generate_module, "Decoder", Restarting)
    monkeypatch.setattr(generate_module, "next_token", lambda *args: next(state["drawn"]))


def test_generation_ends_at_the_eod_and_never_shows_its_text(run, capsys, monkeypatch):
    """A drawn EOD ends the document: generation stops right after it (the budget not spent on text past
    the end), and `megadiff generate` prints the text before it, not the EOD's own text."""
    output_dir, reference = run
    tokenizer = load_tokenizer(reference.cfg.data.tokenizer)
    before, after = tokenizer.encode(" God said"), tokenizer.encode(" Let there be light")
    script = before + [tokenizer.eod] + after
    scripted_draws(monkeypatch, script)
    new = generate(reference, [5, 6, 7], max_new_tokens=len(script), stop_ids=tokenizer.eos_ids)
    assert new == before + [tokenizer.eod]
    assert main(["generate", "--load", str(output_dir), "--prompt", PROMPT, "--max-new-tokens", str(len(script))]) == 0
    out = capsys.readouterr().out
    assert out == PROMPT + tokenizer.decode(before) + "\n"
    assert tokenizer.decode([tokenizer.eod]) not in out


def test_a_batch_row_ends_at_its_eod_while_the_others_go_on(run, monkeypatch):
    """Side by side, the row that draws the EOD stops there; the other row spends its whole budget."""
    _, reference = run
    eod = reference.tokenizer.eod
    steps = [[20, 30], [21, 31], [eod, 32], [22, 33], [23, 34]]
    drawn = iter(steps)
    # asked for the rows still drawing only: once the first row ends, the second's draw
    monkeypatch.setattr(generate_module, "next_tokens", lambda logits, *args: next(drawn)[-len(logits):])
    answers = generate_batch(reference, [[5, 6, 7], [8, 9, 10]], len(steps), stop_ids=[eod])
    assert answers == [[step[0] for step in steps[:3]], [step[1] for step in steps]]


def test_generation_draws_only_ids_the_tokenizer_decodes(run):
    """cl100k_base has ids no token has (100256, 100261-100275): generation never draws them nor the
    embedding's padding, and decoding one is no error."""
    tokenizer = load_tokenizer("cl100k_base")
    holes = [100256] + list(range(100261, 100276))
    decodable = decodable_ids(SimpleNamespace(tokenizer=tokenizer, vocab_size=100352))
    assert (~decodable).nonzero().flatten().tolist() == holes + list(range(tokenizer.vocab_size, 100352))
    assert TextStream(tokenizer).add(100256) == "" and tokenizer.decode([100256, 9906]) == "Hello"
    _, reference = run
    greedy = generate(reference, [5, 6, 7], max_new_tokens=1)
    allowed = torch.ones(reference.vocab_size, dtype=torch.bool)
    allowed[greedy] = False
    assert generate(reference, [5, 6, 7], max_new_tokens=1, decodable=allowed) != greedy


def test_a_budget_below_one_new_token_is_refused_before_the_checkpoint_is_read(run, capsys, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi"}\n')
    missing = str(tmp_path / "no-run")
    for command, option, value, message in [
            (["generate", "--prompt", "Hi"], "--max-new-tokens", "0", "max_new_tokens"),
            (["generate", "--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "out")],
             "--max-new-tokens", "-1", "max_new_tokens"),
            (["chat"], "--max-new-tokens", "0", "max_new_tokens"),
            (["generate", "--prompt", "Hi"], "--top-p", "0", "top_p"),
            (["generate", "--prompt", "Hi"], "--top-k", "-1", "top_k"),
            # a negative temperature read as greedy; NaN and inf failed in torch once the checkpoint was read
            (["generate", "--prompt", "Hi"], "--temperature", "-1", "temperature (--temperature) must be"),
            (["generate", "--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "out")],
             "--temperature", "nan", "temperature (--temperature) must be"),
            (["chat"], "--temperature", "inf", "temperature (--temperature) must be")]:
        assert main([command[0], "--load", missing, *command[1:], option, value]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        generate_batch(run[1], [[5, 6, 7]], 0)


def test_generate_cli_samples_from_the_nucleus(run, capsys):
    """--top-p small enough that the nucleus is the likeliest id alone: greedy text at any temperature."""
    assert cli_text(run[0], capsys, "--temperature", "5", "--top-p", "1e-9", "--seed", "3") == cli_text(run[0], capsys)


@pytest.mark.parametrize("tokenizer_name", ["cl100k_base", "kjv-bpe"])
def test_stop_texts_are_found_in_the_last_tokens_where_the_whole_text_first_holds_them(tokenizer_name,
                                                                                      small_tokenizer_dir):
    """generate_batch stops at the first step its check answers True: decoding the last tokens only
    answers so at the step decoding every new token first would, multi-byte characters cut between
    tokens included, and never decodes more of them."""
    tokenizer = load_tokenizer("cl100k_base" if tokenizer_name == "cl100k_base" else str(small_tokenizer_dir))
    ids = tokenizer.encode("In the beginning was the λόγος; 道可道，非常道。 And God said @@ let there be ÿ light.\n\nEnd")
    decoded = []

    class Counting:
        def decode(self, part):
            decoded.append(len(part))
            return tokenizer.decode(part)

    for stops in (["λόγος"], ["非常道"], ["@@"], ["\n\n"], [" light", "ÿ"], ["never there"]):
        decoded.clear()
        check = stop_texts_check(Counting(), stops)
        whole = next((end for end in range(1, len(ids) + 1)
                      if any(stop in tokenizer.decode(ids[:end]) for stop in stops)), None)
        assert next((end for end in range(1, len(ids) + 1) if check(ids[:end])), None) == whole, stops
        assert max(decoded) <= 4 * max(len(stop) for stop in stops) + 2


def pre_training_between_uses_of_a_loaded_model(checkpoint: str, overrides: list[str], report: str) -> None:
    """In this plain process (a notebook's): a loaded model's logits, a pre-training run, the same model's logits
    again; reports whether they are equal, and the run's losses."""
    import json

    from megadiff.config import load_config
    from megadiff.training.pretrain import pretrain
    from tests.pretrain_runs import DEMO_CONFIG, losses

    model = load_checkpoint(checkpoint)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
    cfg = load_config(DEMO_CONFIG, overrides)
    assert pretrain(cfg) == 0
    with torch.no_grad():
        unchanged = torch.equal(model(ids), before)
    Path(report).write_text(json.dumps({"unchanged": unchanged, "losses": losses(Path(cfg.output_dir))}))


def test_a_pre_training_run_leaves_the_models_loaded_before_it_working(run, small_tokenizer_dir, tmp_path):
    """A notebook loads a checkpoint, pre-trains another model, then uses the loaded one again: it gives the
    logits it gave (the run's end released the model-parallel groups its layers read, and its forward failed), and
    the run trains as in a process of its own."""
    import json
    import subprocess
    import sys

    from tests.pretrain_runs import ROOT, environment, losses, run_pretrain, tiny_overrides

    overrides = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + ["train.iters=3"]
    report = tmp_path / "report.json"
    program = ("import sys, json; from tests.test_inference import pre_training_between_uses_of_a_loaded_model as "
               "run; run(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])")
    arguments = [str(run[0]), json.dumps(overrides + [f"output_dir={tmp_path / 'after'}"]), str(report)]
    proc = subprocess.run([sys.executable, "-c", program, *arguments], env=environment(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_pretrain(1, overrides + [f"output_dir={tmp_path / 'alone'}"])
    assert json.loads(report.read_text()) == {"unchanged": True, "losses": losses(tmp_path / "alone")}


def pre_training_in_another_layout_after_a_load(rank: int, world_size: int, checkpoint: str, overrides: list[str],
                                                report: str) -> None:
    """In each rank of a torchrun'd script: load_checkpoint (its TP 1 groups), then pre-training with
    parallel.tensor=2; rank 0 reports the run's refusal."""
    from megadiff.config import ConfigError, load_config
    from megadiff.training.pretrain import pretrain
    from tests.pretrain_runs import DEMO_CONFIG

    load_checkpoint(checkpoint)
    try:
        pretrain(load_config(DEMO_CONFIG, overrides + ["parallel.tensor=2"], world_size=world_size))
        refusal = "trained"
    except ConfigError as error:
        refusal = str(error)
    if rank == 0:
        Path(report).write_text(refusal)


def test_a_run_asking_for_another_layout_than_the_process_s_groups_is_refused(run, small_tokenizer_dir, tmp_path):
    """A script under torchrun loads a checkpoint (its model-parallel groups: TP 1), then pre-trains with TP 2: the run
    trained silently in the loaded model's layout, its log naming TP 2, its losses other than a TP 2 run's."""
    from tests.distributed import run_ranks
    from tests.pretrain_runs import tiny_overrides

    overrides = tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + [f"output_dir={tmp_path / 'run'}",
                                                                           "train.iters=2"]
    report = tmp_path / "refusal.txt"
    run_ranks(2, pre_training_in_another_layout_after_a_load, str(run[0]), overrides, str(report))
    assert "parallel: TP 2, PP 1, CP 1 asked, but this process holds the model-parallel groups of TP 1, PP 1, CP 1" \
        in report.read_text()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
