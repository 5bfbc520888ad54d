"""`megadiff icl`: many-shot in-context classification against prompts and constrained greedy
decoding written out here, on a checkpoint of drawn weights and KJV verses labelled by a rule;
two gloo ranks against one process; a Hugging Face model (--hf): the checkpoint's export answers as
the checkpoint, a Dex-adapted Llama as the naive decoding through transformers."""
from __future__ import annotations

import copy
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, iteration_dir
from megadiff.cli import main
from megadiff.config import build_config
from megadiff.inference.icl import (
    Example, accuracy_grid, arranged, default_shots, demonstration, label_tokens, query,
)
from megadiff.checkpoint.single_process import load_checkpoint
from tests.conftest import kjv_verses
from tests.convert_worker import build_tokenizer, save_in_process, variant_config
from tests.distributed import run_ranks

WINDOW = 256


def rule_label(verse: str) -> str:
    return "divine" if "God" in verse else "earthly" if "earth" in verse else "plain"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("icl")
    verses = kjv_verses()
    for split, chosen in (("train", verses[:60]), ("test", verses[100:140])):
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"text": v[:30], "label": rule_label(v)}) + "\n"
                                                     for v in chosen))
    cfg = build_config(variant_config("diff", "single", str(build_tokenizer(root / "tokenizer"))).model_dump(
        mode="json"), [f"model.seq_length={WINDOW}"])
    save_in_process(cfg, iteration_dir(root / "run" / CHECKPOINTS_DIR, 1))
    (root / "run" / CHECKPOINTS_DIR / LATEST_FILE).write_text("1")
    return root


def examples(root: Path, split: str) -> list[Example]:
    return [Example(**json.loads(line)) for line in (root / f"{split}.jsonl").read_text().splitlines()]


def naive_answer(model, prompt: list[int], candidates: list[list[int]]) -> int:
    """Greedy decoding over the whole vocabulary's logits, every token outside the candidates'
    continuations masked, until the tokens spell one candidate."""
    ids = list(prompt)
    while True:
        done = len(ids) - len(prompt)
        matching = [i for i, c in enumerate(candidates) if c[:done] == ids[len(prompt):]]
        if len(matching) == 1:
            return matching[0]
        logits = model(torch.tensor([ids]))[0, -1].clone()
        mask = torch.ones_like(logits, dtype=torch.bool)
        mask[[candidates[i][done] for i in matching]] = False
        ids.append(int(logits.masked_fill(mask, float("-inf")).argmax()))


def test_arrangements_keep_the_demonstrations():
    draw = [Example(f"s{i}", label) for i, label in enumerate("aabacbbca")]
    assert arranged(draw, "random", 0) == draw
    shuffled = arranged(draw, "random", 3)
    assert shuffled != draw and sorted(shuffled, key=lambda e: e.text) == draw
    dealt = arranged(draw, "by-class", 3)
    assert sorted(dealt, key=lambda e: e.text) == draw
    # classes take turns (in the order they first come) until each runs out: a b c a b c a b a
    firsts = list(dict.fromkeys(e.label for e in shuffled))
    counts = {label: [e.label for e in draw].count(label) for label in firsts}
    assert [e.label for e in dealt] == [label for turn in range(4) for label in firsts if counts[label] > turn]
    for label in firsts:  # each class in the shuffled order
        assert [e for e in dealt if e.label == label] == [e for e in shuffled if e.label == label]


def test_default_shots_fill_the_window(root):
    tokenizer = load_checkpoint(root / "run").tokenizer
    draw, tests = examples(root, "train"), examples(root, "test")
    shots = default_shots(tokenizer, draw, tests, WINDOW)
    most = shots[-1]
    assert shots[:-1] == [2 ** i for i in range(len(shots) - 1)] and shots[-2] < most <= 2 * shots[-2]
    fixed = max(len(tokenizer.encode(f"sentence: {e.text}\nlabel:")) for e in tests) + max(
        len(t) for t in label_tokens(tokenizer, ["divine", "earthly", "plain"]))

    def demos(k: int) -> int:
        return sum(len(tokenizer.encode(f"sentence: {e.text}\nlabel: {e.label}\n\n")) for e in draw[:k])
    assert demos(most) + fixed <= WINDOW < demos(most + 1) + fixed


def test_accuracy_equals_naive_constrained_decoding(root, monkeypatch):
    """...with each cell's demonstrations run once, every query continuing them in the KV cache."""
    from megadiff.models.kv_cache import KVCache

    marks = []
    real_mark = KVCache.mark
    monkeypatch.setattr(KVCache, "mark", lambda self: marks.append(self.length) or real_mark(self))
    model = load_checkpoint(root / "run")
    tokenizer = model.tokenizer
    draw, tests = examples(root, "train"), examples(root, "test")[:8]
    shots, orders = [1, 3], 2
    grid = accuracy_grid(model, draw, tests, shots, orders, "by-class")

    names = ["divine", "earthly", "plain"]
    prefix = tokenizer.encode("label:")
    candidates = [tokenizer.encode(f"label: {name}\n\n")[len(prefix):] for name in names]
    answers = set()
    for i, count in enumerate(shots):
        for order in range(orders):
            context = "".join(f"sentence: {e.text}\nlabel: {e.label}\n\n"
                              for e in arranged(draw[:count], "by-class", order))
            right = 0
            for example in tests:
                prompt = tokenizer.encode(context + f"sentence: {example.text}\nlabel:")
                assert len(prompt) + max(map(len, candidates)) <= WINDOW
                with torch.no_grad():
                    answer = names[naive_answer(model, prompt, candidates)]
                answers.add(answer)
                right += answer == example.label
            assert grid[i, order].item() == pytest.approx(right / len(tests)), (count, order)
    assert len(answers) > 1, "every prompt got the same answer: the comparison would prove little"
    assert len(marks) == len(shots) * orders and min(marks) > 0


def test_one_cells_cache_is_freed_before_the_next_cells_is_allocated(root, monkeypatch):
    """Each cell's shared context holds a cache as long as its prompts (a 64K window's, 34 GB for a 6.8B
    model): two at once would not fit beside the weights."""
    from megadiff.models.kv_cache import KVCache

    caches, alive = [], []
    real_init = KVCache.__init__

    def tracked(self, *args, **kwargs):
        alive.append(sum(cache() is not None for cache in caches))
        real_init(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    monkeypatch.setattr(KVCache, "__init__", tracked)
    accuracy_grid(load_checkpoint(root / "run"), examples(root, "train"), examples(root, "test")[:2], [1, 2], 2,
                  "random")
    assert len(alive) == 4 and alive == [0, 0, 0, 0]


def _icl(rank: int, world_size: int, root: str, output: str, *extra: str) -> None:
    source = [] if "--hf" in extra else ["--load", f"{root}/run"]
    assert main(["icl", *source, "--dataset", root, "--examples", "7", "--orders", "2", "--output", output,
                 *extra]) == 0


def test_an_exported_model_answers_as_its_checkpoint(root, tmp_path):
    """--hf on the run's Hugging Face export (stock DiffLlama, run by transformers): the same
    default shots (its max_position_embeddings is the run's window) and the same accuracies, on
    one process or two gloo ranks."""
    assert main(["convert", "to-hf", "--load", str(root / "run"), "--save", str(tmp_path / "hf")]) == 0
    _icl(0, 1, str(root), str(tmp_path / "run.json"))
    _icl(0, 1, str(root), str(tmp_path / "hf.json"), "--hf", str(tmp_path / "hf"), "--dtype", "fp32")
    ours, theirs = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("run", "hf"))
    assert theirs["checkpoint"] == str(tmp_path / "hf") and theirs["window"] == WINDOW
    assert theirs["by_shots"] == ours["by_shots"] and len(ours["by_shots"]) > 2
    run_ranks(2, _icl, str(root), str(tmp_path / "two.json"), "--hf", str(tmp_path / "hf"), "--dtype", "fp32")
    assert json.loads((tmp_path / "two.json").read_text()) == theirs  # each rank a share, as with --load


def test_a_dint_export_answers_as_its_checkpoint(root, tmp_path):
    """DINT exports with megadiff's own modeling code, whose cache also holds the integral's running
    sum: the copies the demonstrations' cache is rewound to carry it, so answers are the run's; its
    per-token losses and chosen logits (evaluate, needles) are the run's too."""
    from megadiff.inference.hf_model import load_hf_model

    cfg = build_config(variant_config("dint", "single", str(root / "tokenizer")).model_dump(mode="json"),
                       [f"model.seq_length={WINDOW}"])
    save_in_process(cfg, iteration_dir(tmp_path / "run" / CHECKPOINTS_DIR, 1))
    (tmp_path / "run" / CHECKPOINTS_DIR / LATEST_FILE).write_text("1")
    assert main(["convert", "to-hf", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "hf")]) == 0
    draw, tests = examples(root, "train"), examples(root, "test")[:8]
    run, export = load_checkpoint(tmp_path / "run", torch.float32), load_hf_model(tmp_path / "hf", "fp32")
    assert torch.equal(accuracy_grid(export, draw, tests, [1, 4], 2, "random"),
                       accuracy_grid(run, draw, tests, [1, 4], 2, "random"))
    # and what evaluate and needles ask of it: per-token losses, chosen positions' logits
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(export(ids[:, :-1], ids[:, 1:]), run(ids[:, :-1], ids[:, 1:]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(export.logits_at(ids, [3, 39]), run.logits_at(ids, [3, 39]), rtol=1e-4, atol=1e-4)


def test_an_adapted_model_answers_as_naive_constrained_decoding(root, tmp_path):
    """A Dex-adapted Llama saved as adaptation exports it (remote code), its tokenizer putting a BOS
    before every text as Llama's does: every cell's accuracy is the naive decoding's through the
    transformers model of the prompt as its tokenizer encodes a text (BOS first), the demonstrations
    run once per cell (the cache copied back to them for each query)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megadiff.adapt import apply_dex
    from megadiff.adapt.export import save_adapted
    from megadiff.inference.hf_model import load_hf_model
    from tests.test_adapt import perturb_adapters

    hf_tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tokenizer", bos="<s>", adds_bos=True))
    torch.manual_seed(2)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         initializer_range=0.2, max_position_embeddings=WINDOW)).eval()
    adapted = apply_dex(llama, {}, calibration=[torch.randint(0, len(hf_tokenizer), (2, 16))])
    perturb_adapters(adapted, 4, anneal_steps=10)
    save_adapted(adapted, tmp_path / "dex", tokenizer=hf_tokenizer)
    model = load_hf_model(tmp_path / "dex")
    draw, tests = examples(root, "train"), examples(root, "test")[:8]
    shots = [1, 3]
    grid = accuracy_grid(model, draw, tests, shots, 1, "random")

    names = ["divine", "earthly", "plain"]
    tokenizer = model.tokenizer
    prefix = tokenizer.encode("label:")
    candidates = [tokenizer.encode(f"label: {name}\n\n")[len(prefix):] for name in names]
    answers = set()
    for i, count in enumerate(shots):
        context = "".join(f"sentence: {e.text}\nlabel: {e.label}\n\n" for e in draw[:count])
        right = 0
        for example in tests:
            prompt = hf_tokenizer(context + f"sentence: {example.text}\nlabel:")["input_ids"]
            assert prompt[0] == hf_tokenizer.bos_token_id
            with torch.no_grad():
                answer = names[naive_answer(lambda ids: adapted(ids).logits, prompt, candidates)]
            answers.add(answer)
            right += answer == example.label
        assert grid[i, 0].item() == pytest.approx(right / len(tests)), count
    assert len(answers) > 1, "every prompt got the same answer: the comparison would prove little"


def test_two_ranks_report_what_one_process_reports(root, tmp_path, capfd):
    run_ranks(2, _icl, str(root), str(tmp_path / "two.json"))
    rank0, _, rank1 = capfd.readouterr().err.partition("----- rank 1 -----")
    assert "icl " in rank0 and "tokens/s on 2 ranks" in rank0 and "accuracy" not in rank1
    _icl(0, 1, str(root), str(tmp_path / "one.json"))
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    assert two == one
    assert [row["shots"] for row in one["by_shots"]][:2] == [1, 2] and one["examples"] == 7


def test_an_interrupted_run_resumes_from_its_cache(root, tmp_path, monkeypatch, capsys):
    """--cache keeps each answer as it comes: a run failing at its sixth answer, rerun, answers only
    the rest and reports what an uninterrupted run does; more orders add only their answers; the
    cache of another request is refused. Two ranks' caches serve one process."""
    from megadiff.inference import icl

    computed = {"answers": 0, "fail_at": None}
    real_answer = icl.constrained_answer

    def counted_answer(*args):
        computed["answers"] += 1
        if computed["answers"] == computed["fail_at"]:
            raise RuntimeError("preempted")
        return real_answer(*args)

    monkeypatch.setattr(icl, "constrained_answer", counted_answer)
    _icl(0, 1, str(root), str(tmp_path / "whole.json"))
    total = computed["answers"]
    cache = ("--cache", str(tmp_path / "answers"))
    computed.update(answers=0, fail_at=6)
    with pytest.raises(RuntimeError, match="preempted"):
        _icl(0, 1, str(root), str(tmp_path / "first.json"), *cache)
    computed.update(answers=0, fail_at=None)
    _icl(0, 1, str(root), str(tmp_path / "resumed.json"), *cache)
    assert computed["answers"] == total - 5
    whole, resumed = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("whole", "resumed"))
    assert resumed == whole

    computed["answers"] = 0
    _icl(0, 1, str(root), str(tmp_path / "three.json"), *cache, "--orders", "3")
    assert computed["answers"] == total // 2  # the third order's answers alone
    three = json.loads((tmp_path / "three.json").read_text())
    assert [row["by_order"][:2] for row in three["by_shots"]] == [row["by_order"] for row in whole["by_shots"]]

    capsys.readouterr()
    assert main(["icl", "--load", f"{root}/run", "--dataset", str(root), "--examples", "7", "--seed", "1",
                 *cache]) == 2
    assert "another request" in capsys.readouterr().err
    assert main(["icl", "--load", f"{root}/run", "--dataset", str(root), "--examples", "7", "--dtype", "bf16",
                 *cache]) == 2  # the answers of fp32 weights are not those of bf16 ones
    assert "another request" in capsys.readouterr().err

    run_ranks(2, _icl, str(root), str(tmp_path / "two.json"), "--cache", str(tmp_path / "ranks"))
    computed["answers"] = 0
    _icl(0, 1, str(root), str(tmp_path / "from-ranks.json"), "--cache", str(tmp_path / "ranks"))
    assert computed["answers"] == 0
    assert json.loads((tmp_path / "from-ranks.json").read_text()) == whole
    assert sorted(path.name for path in tmp_path.glob("ranks_rank*.jsonl")) == ["ranks_rank0.jsonl",
                                                                                 "ranks_rank1.jsonl"]


def test_a_cache_serves_the_weights_and_window_it_was_answered_with(root, tmp_path, monkeypatch, capsys):
    """The request holds the dtype the weights are in: --dtype naming the run's own (fp32) takes
    what omitting it kept. A cache kept before requests held window and dtype was answered with the
    model's own: a rerun leaving both to the model takes it, one asking for bf16 is refused. One kept
    before prompts began with the tokenizer's text start, of a tokenizer that has none, is served; one
    kept before labels ended as the demonstrations do is refused."""
    from megadiff.inference import icl

    computed = []
    real_answer = icl.constrained_answer
    monkeypatch.setattr(icl, "constrained_answer", lambda *args: computed.append(1) or real_answer(*args))
    cache = tmp_path / "answers"

    def run(*extra: str) -> int:
        return main(["icl", "--load", f"{root}/run", "--dataset", str(root), "--examples", "3", "--shots", "1",
                     "--cache", str(cache), *extra])

    assert run() == 0 and len(computed) == 3
    assert run("--dtype", "fp32") == 0 and len(computed) == 3
    rank_file = tmp_path / "answers_rank0.jsonl"
    records = [json.loads(line) for line in rank_file.read_text().splitlines()]

    def kept_without(*keys: str) -> None:
        older = json.loads(json.dumps(records))
        for record in older:
            for key in keys:
                del record["request"][key]
        rank_file.write_text("".join(json.dumps(record) + "\n" for record in older))

    kept_without("window", "dtype")
    assert run() == 0 and len(computed) == 3
    # kept before prompts began with the tokenizer's text start: this one's has none (nor a BOS)
    kept_without("window", "dtype", "text_start")
    assert run() == 0 and len(computed) == 3
    capsys.readouterr()
    assert run("--dtype", "bf16") == 2
    assert "another request" in capsys.readouterr().err
    # older still: its labels ended with one newline, where the demonstrations' end with two
    kept_without("window", "dtype", "label_end")
    assert run() == 2
    assert "another request" in capsys.readouterr().err


def test_mistakes_are_refused_before_the_checkpoint_is_read(root, tmp_path, capsys):
    missing = str(tmp_path / "no-run")
    assert main(["icl", "--load", missing, "--dataset", str(root), "--label-key", "intent"]) == 2
    assert "intent" in capsys.readouterr().err
    assert main(["icl", "--load", missing, "--dataset", str(root), "--shots", "61"]) == 2
    assert "61" in capsys.readouterr().err
    assert main(["icl", "--load", missing, "--dataset", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err
    # a split's file for the directory: read as a hub name, it spent half a minute on retries
    assert main(["icl", "--load", missing, "--dataset", str(root / "train.jsonl")]) == 2
    assert f"--dataset {root / 'train.jsonl'} is a file: give the directory holding train.jsonl" in \
        capsys.readouterr().err
    for empty_split, text in (("train", ""), ("test", "\n")):
        emptied = tmp_path / f"empty-{empty_split}"
        shutil.copytree(root, emptied)
        (emptied / f"{empty_split}.jsonl").write_text(text)
        assert main(["icl", "--load", missing, "--dataset", str(emptied)]) == 2
        assert f"{empty_split}.jsonl holds no examples" in capsys.readouterr().err
    # a split that is not JSON lines (a traceback from datasets), and rows without a label (scored as "None")
    for split, text, said in (("test", "{not json\n", "cannot read the test split of"),
                              ("train", '{"text": "In the beginning", "label": null}\n', "1 examples lack their")):
        damaged = tmp_path / f"damaged-{split}"
        shutil.copytree(root, damaged)
        (damaged / f"{split}.jsonl").write_text(text)
        assert main(["icl", "--load", missing, "--dataset", str(damaged)]) == 2
        assert said in capsys.readouterr().err
    assert main(["icl", "--hf", missing, "--dataset", str(root)]) == 2
    assert "no config.json" in capsys.readouterr().err
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=300, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(tmp_path / "weightless")
    assert main(["icl", "--hf", str(tmp_path / "weightless"), "--dataset", str(root)]) == 3
    assert "no usable Hugging Face tokenizer files" in capsys.readouterr().err
    assert main(["icl", "--load", missing, "--dataset", str(root), "--window", "64"]) == 2
    assert "--window is a Hugging Face model's" in capsys.readouterr().err


def _byte_level_bpe(directory: Path):
    """A GPT-2-style tokenizer (byte-level BPE, GPT-2's split) that learned "\\n\\n" as one token at a
    text's end, where it splits them before a word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megadiff.data.tokenizers import load_tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([f"sentence: It rained all day.\nlabel: {label}\n\n" for label in ("good", "bad")] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(str(directory))
    return load_tokenizer(str(directory))


def test_a_label_is_decoded_as_the_demonstrations_write_it(tmp_path):
    """Constrained decoding continues a query with the very tokens a demonstration's label and its end
    are, the next demonstration following: a label that is another's prefix ends with the token the
    model saw after labels."""
    from megadiff.data.tokenizers import load_tokenizer

    gpt2_style = _byte_level_bpe(tmp_path / "bpe")
    assert gpt2_style.encode("\n\n") != gpt2_style.encode("\n\nsentence")[:len(gpt2_style.encode("\n\n"))]
    for tokenizer in (load_tokenizer("cl100k_base"), gpt2_style):
        following = tokenizer.encode("sentence:")
        for label in ("good", "good news", "bad"):
            example = Example("It rained all day.", label)
            written = tokenizer.encode(demonstration(example) + "sentence:")
            assert written == tokenizer.encode(query(example)) + label_tokens(tokenizer, [label])[0] + following


def held_bytes(*holders) -> int:
    """Bytes of the distinct storages of the (non-scalar) tensors reachable from `holders` through attributes,
    lists, tuples and dicts: what a cache and its marks keep alive."""
    storages, seen, pending = {}, set(), list(holders)
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.dim():
                storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, (type, torch.nn.Module)):
            pending.extend(vars(item).values())
    return sum(storages.values())


def position_bytes(layer) -> int:
    """A cache layer's bytes per position of its keys and values, from their shapes."""
    return sum(t.element_size() * t.numel() // t.shape[-2] for t in (layer.keys, layer.values))


def allowed_bytes(cache) -> int:
    """One copy of what `cache` holds plus what rewinding needs, from the shapes: a full-attention layer's keys and
    values of every position once; a sliding window's twice (the cache's, over the last call's token too, and the
    mark's); DINT's running sums twice."""
    total = 0
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        rows = cache.get_seq_length() if window is None else (window - 1 + 1) + (window - 1)
        total += rows * position_bytes(layer)
        total += 2 * sum(state.nbytes for state in getattr(layer, "recurrent_states", {}).values() if state is not None)
    return total


def dint_export(root: Path, tmp_path: Path):
    from megadiff.inference.hf_model import load_hf_model

    cfg = build_config(variant_config("dint", "single", str(root / "tokenizer")).model_dump(mode="json"),
                       [f"model.seq_length={WINDOW}"])
    save_in_process(cfg, iteration_dir(tmp_path / "run" / CHECKPOINTS_DIR, 1))
    (tmp_path / "run" / CHECKPOINTS_DIR / LATEST_FILE).write_text("1")
    assert main(["convert", "to-hf", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "hf")]) == 0
    return load_hf_model(tmp_path / "hf", "fp32").hf


def sliding_window_model():
    """A Qwen2 whose second layer attends over a sliding window of 8 positions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                        use_sliding_window=True, max_window_layers=1,
                                        max_position_embeddings=WINDOW)).eval()


@pytest.mark.parametrize("kind", ["dint", "sliding window"])
def test_a_rewound_hf_cache_holds_the_demonstrations_once(root, tmp_path, kind):
    """--hf's shared demonstrations (40 tokens), rewound to for three queries of 6 tokens (two calls each): the
    answers of a whole forward and of a fresh copy of the demonstrations' cache for each query, the cache and its
    mark holding one copy of the keys and values (plus a sliding window's rows and DINT's running sums)."""
    from megadiff.inference.hf_model import HFCache

    hf = dint_export(root, tmp_path) if kind == "dint" else sliding_window_model()
    draw = torch.Generator().manual_seed(8)
    demonstrations = torch.randint(1, 300, (1, 40), generator=draw)
    queries = [torch.randint(1, 300, (1, 6), generator=draw) for _ in range(3)]

    def last_logits(ids, cache):
        return hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]

    cache = HFCache(hf)
    with torch.no_grad():
        last_logits(demonstrations, cache.cache)
        mark, copied = cache.mark(), copy.deepcopy(cache.cache)
        for asked in queries:
            cache.rewind(mark)
            last_logits(asked[:, :5], cache.cache)
            got = last_logits(asked[:, 5:], cache.cache)
            fresh = copy.deepcopy(copied)
            last_logits(asked[:, :5], fresh)
            assert torch.equal(got, last_logits(asked[:, 5:], fresh))
            whole = hf(input_ids=torch.cat([demonstrations, asked], dim=1), use_cache=False).logits[:, -1]
            torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
            assert cache.length == 46
            assert held_bytes(cache.cache, mark) <= allowed_bytes(cache.cache)
