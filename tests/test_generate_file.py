"""`megadiff generate --prompts FILE --output OUT`: every prompt's completion is what generating it
alone gives, in FILE's order; chat prompts are the template's; a run stopped after a batch,
rerun, generates only the rest; two gloo ranks write what one process does; mistakes are refused
before the checkpoint is read."""
from __future__ import annotations

import io
import json
from pathlib import Path
from unittest import mock

import pytest

from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, iteration_dir
from megadiff.cli import main
from megadiff.config import build_config
from megadiff.inference import load_checkpoint
from megadiff.inference.generate import decodable_ids, generate
from tests.conftest import kjv_verses
from tests.convert_worker import save_in_process, variant_config
from tests.distributed import run_ranks
from tests.test_inference import MARKUP_MESSAGE, chatml_tokenizer, training_prompt

WINDOW = 256
NEW = 6
SAMPLED = ("--temperature", "1.0", "--top-k", "50", "--seed", "7")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A DIFF run (window 256) trained on ChatML conversations (ChatML's special tokens in its
    tokenizer), and a file of 7 prompts of 1 to 40 tokens."""
    from tests.test_chat_data import CHATML

    root = tmp_path_factory.mktemp("generate_file")
    cfg = build_config(variant_config("diff", "single", str(chatml_tokenizer(root / "tokenizer"))).model_dump(
        mode="json"), [f"model.seq_length={WINDOW}", "data.messages_key=messages", f"data.chat_template={CHATML}"])
    save_in_process(cfg, iteration_dir(root / "run" / CHECKPOINTS_DIR, 1))
    (root / "run" / CHECKPOINTS_DIR / LATEST_FILE).write_text("1")
    verses = kjv_verses()
    lines = [{"prompt": verses[i][:3 + 9 * i]} for i in range(6)] + [{"id": "last", "prompt": verses[9][:20]}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def completions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_file(root: Path, output: Path, *extra: str) -> None:
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(root / "prompts.jsonl"), "--output",
                 str(output), "--max-new-tokens", str(NEW), "--batch-size", "3", *extra]) == 0


def test_each_completion_is_the_prompts_own_generation(root, tmp_path):
    run_file(root, tmp_path / "out.jsonl")
    model = load_checkpoint(root / "run")
    tokenizer = model.tokenizer
    prompts = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    got = completions(tmp_path / "out.jsonl")
    assert [row["id"] for row in got] == ["1", "2", "3", "4", "5", "6", "last"]
    for row, prompt in zip(got, prompts):
        new = generate(model, tokenizer.encode(prompt["prompt"]), max_new_tokens=NEW, stop_ids=tokenizer.eos_ids,
                       decodable=decodable_ids(model))
        assert row["new_tokens"] == len(new) and row["completion"] == tokenizer.decode(
            [token for token in new if token != tokenizer.eod])
        assert row["finish"] == ("stop" if new[-1] == tokenizer.eod else "length")
    assert any(row["completion"] for row in got)


def test_a_prompt_longer_than_the_window_keeps_its_end(root, tmp_path):
    model = load_checkpoint(root / "run")
    tokenizer = model.tokenizer
    text = " ".join(kjv_verses()[:40])
    ids = tokenizer.encode(text)
    assert len(ids) > WINDOW
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": text}) + "\n")
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(tmp_path / "long.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW)]) == 0
    new = generate(model, ids[-(WINDOW - NEW):], max_new_tokens=NEW, stop_ids=tokenizer.eos_ids,
                   decodable=decodable_ids(model))
    (row,) = completions(tmp_path / "out.jsonl")
    assert row["new_tokens"] == len(new) and row["completion"] == tokenizer.decode(
        [token for token in new if token != tokenizer.eod])


def test_a_completion_ended_by_the_eod_is_recorded_as_stopped(root, tmp_path, monkeypatch):
    """A model that draws the EOD has finished: the record says "stop" (not "length", which tells a user the
    budget cut the text short), counts the EOD among its new tokens, and its text leaves the EOD's out."""
    import megadiff.inference.generate as generate_module

    tokenizer = load_checkpoint(root / "run").tokenizer
    before = tokenizer.encode(" and the earth")
    script = iter(before + [tokenizer.eod])
    monkeypatch.setattr(generate_module, "next_tokens", lambda logits, *args: [next(script)] * logits.shape[0])
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "In the beginning God created the heaven"}) + "\n")
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(tmp_path / "prompts.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(len(before) + 3)]) == 0
    (row,) = completions(tmp_path / "out.jsonl")
    assert row == {"id": "1", "completion": tokenizer.decode(before), "new_tokens": len(before) + 1, "finish": "stop"}


def test_chat_prompts_are_the_templates_and_stop_at_the_turns_end(root, tmp_path, monkeypatch):
    from megadiff.inference import generate_file as module

    seen = []
    real = module.generate_batch

    def watched(model, prompts, *args, **kwargs):
        seen.extend(prompts)
        answers = real(model, prompts, *args, **kwargs)
        # a reply that ends its turn: the stop applies, and the completion keeps the text before it
        ending = model.tokenizer.encode("Seth.<|im_end|>\n")
        assert all(kwargs["stops"][row](ending) for row in range(len(prompts)))
        return [ending] + answers[1:]

    monkeypatch.setattr(module, "generate_batch", watched)
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"from": "human", "value": "Who begat Enos?"}]})
                                          + "\n" + json.dumps({"id": "b", "prompt": "And Enos?"}) + "\n")
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(tmp_path / "chats.jsonl"), "--chat",
                 "--system", "Be brief.", "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "4"]) == 0
    tokenizer = load_checkpoint(root / "run").tokenizer
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert sorted(seen) == sorted(tokenizer.encode(f"{system}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>"
                                                   "assistant\n") for text in ("Who begat Enos?", "And Enos?"))
    first = completions(tmp_path / "out.jsonl")
    assert [row["id"] for row in first] == ["1", "b"]
    stopped = [row for row in first if row["completion"] == "Seth."]
    assert len(stopped) == 1 and stopped[0]["finish"] == "stop"


def test_special_texts_inside_messages_stay_text_as_in_training(root, tmp_path, monkeypatch):
    """A message holding special tokens' texts is prompted as training encodes its conversation."""
    from megadiff.inference import generate_file as module

    seen = []
    real = module.generate_batch
    monkeypatch.setattr(module, "generate_batch", lambda model, prompts, *a, **k: seen.extend(prompts) or
                        real(model, prompts, *a, **k))
    (tmp_path / "chats.jsonl").write_text(json.dumps({"prompt": MARKUP_MESSAGE}) + "\n")
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(tmp_path / "chats.jsonl"), "--chat",
                 "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2"]) == 0
    model = load_checkpoint(root / "run")
    assert seen == [training_prompt([{"role": "user", "content": MARKUP_MESSAGE}], model.cfg.data.chat_template,
                                    model.tokenizer)]


@pytest.mark.parametrize("sampling", [(), SAMPLED], ids=["greedy", "sampled"])
def test_a_stopped_run_generates_only_the_rest(root, tmp_path, monkeypatch, sampling):
    """... and the rest are what the uninterrupted run generated, sampled ones too."""
    from megadiff.inference import generate_file as module

    run_file(root, tmp_path / "whole.jsonl", *sampling)
    real, batches = module.generate_batch, []

    def failing(model, prompts, *args, **kwargs):
        batches.append(len(prompts))
        if len(batches) == 2:
            raise RuntimeError("preempted")
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(module, "generate_batch", failing)
    with pytest.raises(RuntimeError, match="preempted"):
        run_file(root, tmp_path / "out.jsonl", *sampling)
    assert len(completions(tmp_path / "out.jsonl_rank0.jsonl")) == 3  # the first batch, kept
    batches.clear()
    monkeypatch.setattr(module, "generate_batch", lambda *a, **k: batches.append(len(a[1])) or real(*a, **k))
    run_file(root, tmp_path / "out.jsonl", *sampling)
    assert batches == [3, 1]  # the 4 prompts not done
    assert completions(tmp_path / "out.jsonl") == completions(tmp_path / "whole.jsonl")


def test_a_rerun_asking_otherwise_is_refused(root, tmp_path, capsys):
    """Completions kept for other settings, or for a prompt that changed under its id, are never
    handed out: the rerun is refused, naming the file."""
    run_file(root, tmp_path / "out.jsonl")
    capsys.readouterr()
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(root / "prompts.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW + 1)]) == 2
    assert "another request" in capsys.readouterr().err
    changed = tmp_path / "changed.jsonl"
    changed.write_text((root / "prompts.jsonl").read_text().replace('"id": "last", "prompt": "', '"id": "last", '
                                                                    '"prompt": "Behold, '))
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(changed), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW), "--batch-size", "3"]) == 2
    assert "prompt 'last' is not the one" in capsys.readouterr().err
    # other decoding settings draw other completions
    for option, value in (("--top-k", "5"), ("--temperature", "0.5"), ("--seed", "1")):
        assert main(["generate", "--load", str(root / "run"), "--prompts", str(root / "prompts.jsonl"), "--output",
                     str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW), option, value]) == 2
        assert "another request" in capsys.readouterr().err, option
    # weights in another dtype generate otherwise; --dtype naming their own (fp32) asks what omitting it asks
    for dtype, refused in (("bf16", True), ("fp32", False)):
        assert main(["generate", "--load", str(root / "run"), "--prompts", str(root / "prompts.jsonl"), "--output",
                     str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW), "--dtype", dtype]) == 2 * refused
        assert ("another request" in capsys.readouterr().err) == refused


def test_completions_kept_before_the_request_held_top_p_were_sampled_from_every_id(root, tmp_path, monkeypatch,
                                                                                   capsys):
    """Rank files written before the request recorded top_p (all ids: top_p 1) serve a rerun at
    top_p 1; a rerun at another top_p is refused."""
    from megadiff.inference import generate_file as module

    run_file(root, tmp_path / "out.jsonl")
    rank_file = tmp_path / "out.jsonl_rank0.jsonl"
    older = completions(rank_file)
    for record in older:  # nor the weights' window and dtype, whose own ones they were made with
        del record["request"]["top_p"], record["request"]["window"], record["request"]["dtype"]
    rank_file.write_text("".join(json.dumps(record) + "\n" for record in older))
    monkeypatch.setattr(module, "generate_batch", lambda *args, **kwargs: pytest.fail("a kept completion was redone"))
    run_file(root, tmp_path / "out.jsonl")
    capsys.readouterr()
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(root / "prompts.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW), "--top-p", "0.5"]) == 2
    assert "another request" in capsys.readouterr().err


def _ranks(rank: int, world_size: int, root: str, output: str, *extra: str) -> None:
    run_file(Path(root), Path(output), *extra)


@pytest.mark.parametrize("sampling", [(), SAMPLED], ids=["greedy", "sampled"])
def test_two_ranks_write_what_one_process_writes(root, tmp_path, sampling):
    """Sampled too, and in other batches: a prompt's draws are its own (of --seed and its id), not a rank's
    stream's, whose draws depended on the number of ranks and on the prompts batched before it."""
    run_ranks(2, _ranks, str(root), str(tmp_path / "two.jsonl"), *sampling)
    run_file(root, tmp_path / "one.jsonl", *sampling, "--batch-size", "2")
    assert completions(tmp_path / "two.jsonl") == completions(tmp_path / "one.jsonl")
    assert (tmp_path / "two.jsonl_rank1.jsonl").is_file()


def _rank_listing_no_other_ranks_file(rank: int, world_size: int, root: str, output: str) -> None:
    """Rank 0 on a node whose shared filesystem lists the others' new files late (NFS's directory caches): a
    listing of the output's directory shows its own file alone, which opened by its name is there."""
    if rank == 0:
        listed = Path.glob
        Path.glob = lambda self, pattern: (found for found in listed(self, pattern)
                                           if not found.name.endswith("_rank1.jsonl"))
    run_file(Path(root), Path(output))


def test_a_rank_file_another_node_wrote_is_read_though_not_yet_listed(root, tmp_path):
    """Rank 0 found the ranks' files by listing the directory: a file another node had just written, not listed
    yet, was taken for none, and rank 0 failed writing the output (KeyError: a completion it lacked)."""
    run_ranks(2, _rank_listing_no_other_ranks_file, str(root), str(tmp_path / "two.jsonl"))
    run_file(root, tmp_path / "one.jsonl")
    assert completions(tmp_path / "two.jsonl") == completions(tmp_path / "one.jsonl")


@pytest.mark.parametrize("content,extra,message", [
    ("not json\n", (), ":1: not JSON"),
    ('{"text": "x"}\n', (), 'a "prompt" string field is missing'),
    ('"In the beginning"\n', (), ':1: not a JSON object: write each line as {"id": ..., "prompt": "..."}'),
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n', (), "id '1' comes twice"),
    ('{"messages": "hi"}\n', ("--chat",), "messages"),
    ("\n", (), "holds no prompts"),
    ('{"prompt": "a"}\n', ("--batch-size", "0"), "--batch-size must be >= 1"),
])
def test_mistakes_are_refused_before_the_checkpoint_is_read(tmp_path, capsys, content, extra, message):
    (tmp_path / "prompts.jsonl").write_text(content)
    assert main(["generate", "--load", str(tmp_path / "no-run"), "--prompts", str(tmp_path / "prompts.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_prompts_hold_line_separators_as_json_writes_them(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw inside strings: str.splitlines() cut
    such lines in two, and the file was refused as not JSON. CRLF line ends still read."""
    from megadiff.inference.generate_file import read_prompts

    texts = ["first line\u2028second line", "a\u2029b\u0085c", "plain"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\r\n".join(json.dumps({"id": i, "prompt": t}, ensure_ascii=False) for i, t in enumerate(texts)),
                    encoding="utf-8", newline="")
    assert [prompt for _, prompt in read_prompts(str(path), chat=False)] == texts


def test_an_empty_prompt_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    assert main(["generate", "--load", str(tmp_path / "no-run"), "--prompt", ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_output_and_prompts_go_together(tmp_path, capsys):
    assert main(["generate", "--load", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "needs --output" in capsys.readouterr().err
    assert main(["generate", "--load", str(tmp_path), "--prompt", "x", "--output", str(tmp_path / "o")]) == 2
    assert "--prompts FILE" in capsys.readouterr().err


def test_prompts_that_are_not_utf8_are_refused_before_the_checkpoint_is_read(tmp_path, capsys, monkeypatch):
    """A binary file given by mistake: its name and the byte, not the codec's traceback."""
    (tmp_path / "prompts.jsonl").write_bytes(json.dumps({"prompt": "In the beginning"}).encode() + b"\n\x89PNG\n")
    (tmp_path / "prompt.txt").write_bytes(b"In the \xff beginning")
    assert main(["generate", "--load", str(tmp_path / "no-run"), "--prompts", str(tmp_path / "prompts.jsonl"),
                 "--output", str(tmp_path / "out.jsonl")]) == 2
    assert f"--prompts {tmp_path / 'prompts.jsonl'}: not UTF-8 text (invalid start byte at byte 31)" in \
        capsys.readouterr().err
    assert main(["generate", "--load", str(tmp_path / "no-run"), "--prompt-file", str(tmp_path / "prompt.txt")]) == 2
    assert f"--prompt-file {tmp_path / 'prompt.txt'}: not UTF-8 text (invalid start byte at byte 7)" in \
        capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff"), encoding="utf-8"))
    assert main(["generate", "--load", str(tmp_path / "no-run"), "--prompt-file", "-"]) == 2
    assert "standard input: not UTF-8 text" in capsys.readouterr().err


def test_output_that_is_the_prompts_file_is_refused(tmp_path, capsys):
    """The completions replaced the prompts, which were gone for good."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "In the beginning"}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(prompts)
    for output in (prompts, tmp_path / "link.jsonl"):
        assert main(["generate", "--load", str(tmp_path / "no-run"), "--prompts", str(prompts), "--output",
                     str(output)]) == 2
        assert f"--output {output} is the --prompts file" in capsys.readouterr().err
    assert prompts.read_text() == json.dumps({"prompt": "In the beginning"}) + "\n"


def test_batch_size_goes_with_prompts(tmp_path, capsys):
    """A single prompt has nothing to batch: --batch-size with it is refused rather than ignored, and --prompts
    without it decodes 8 side by side."""
    for prompt in (["--prompt", "x"], ["--prompt-file", str(tmp_path / "p.txt")]):
        for size in ("4", "0"):
            assert main(["generate", "--load", str(tmp_path), *prompt, "--batch-size", size]) == 2
            assert "--batch-size is how many prompts of --prompts FILE" in capsys.readouterr().err
    with mock.patch("megadiff.inference.generate_file.generate_file_cli", return_value=0) as generate_file:
        assert main(["generate", "--load", str(tmp_path), "--prompts", "p.jsonl", "--output", "o.jsonl"]) == 0
    assert generate_file.call_args.kwargs["batch_size"] == 8


def test_a_budget_filling_the_window_is_refused(root, tmp_path, capsys):
    """--max-new-tokens as long as the window leaves no token of the prompt in view: refused, not a completion
    of nothing."""
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "In the beginning"}) + "\n")
    assert main(["generate", "--load", str(root / "run"), "--prompts", str(tmp_path / "prompts.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(WINDOW)]) == 2
    assert f"leaves no room for a prompt in the window of {WINDOW}" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_record_after_a_line_cut_short_is_kept(tmp_path):
    """A crash mid-write leaves a half line: the next record goes on a line of its own, so it is read back
    (glued onto the half line, it would be dropped with it, and its completion generated again forever)."""
    from megadiff.inference.records import append_record, read_records

    path = tmp_path / "out.jsonl_rank0.jsonl"
    whole = {"id": "1", "completion": "God"}
    path.write_text(json.dumps(whole) + "\n" + json.dumps({"id": "2", "completion": "light"})[:12])
    append_record(path, {"id": "3", "completion": "waters"})
    assert read_records(path) == [whole, {"id": "3", "completion": "waters"}]


def test_equal_prompts_under_other_ids_or_seeds_sample_apart(root, tmp_path):
    """Each prompt's generator is of --seed and its id: copies of one prompt draw apart (as they did from a
    rank's one stream), and another seed draws otherwise."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": "In the beginning"}) + "\n"
                                                    for i in range(4)))

    def sampled(seed: str) -> list[str]:
        assert main(["generate", "--load", str(root / "run"), "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--output", str(tmp_path / f"out{seed}.jsonl"), "--max-new-tokens", str(NEW),
                     *SAMPLED[:-1], seed]) == 0
        return [row["completion"] for row in completions(tmp_path / f"out{seed}.jsonl")]

    first = sampled("7")
    assert len(set(first)) > 1 and sampled("8") != first
