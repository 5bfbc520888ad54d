"""`megadiff lm-eval`: the harness run on a checkpoint answers every request as the harness's own
Hugging Face model answers it on the checkpoint's export (transformers' DiffLlama, or megadiff's
remote code for DINT), and two gloo ranks that share the requests report what one process does.

The tasks are local (written below, as a user's --include-path): multiple choice with contexts
longer than the model's 32-token window and one empty context, rolling log-likelihood of texts
that take several windows, and generation up to stop strings."""
from __future__ import annotations

import http.server
import json
import multiprocessing
import socketserver
import threading
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megadiff.cli import main
from megadiff.config import ConfigError
from megadiff.convert import convert_to_hf
from megadiff.inference.harness import bootstrap_in_this_process
from tests.conftest import kjv_verses
from tests.convert_worker import build_tokenizer
from tests.test_chat_data import CHATML
from tests.distributed import run_ranks
from tests.held_out_runs import held_out_run
from tests.test_held_out_ranks import counting_sequences

lm_eval = pytest.importorskip("lm_eval")

SEQ_LENGTH, VOCAB_IN_USE = 32, 300  # tests/convert_worker.MODEL's window and tokenizer
TASKS = ["kjv_choice", "kjv_rolling", "kjv_generate"]
TASK_YAML = {
    "kjv_choice": """
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list: [{metric: acc}, {metric: acc_norm, aggregation: median}]  # median: a bootstrapped error bar
""",
    "kjv_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: bits_per_byte}]
""",
    "kjv_generate": """
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: [".", ";"], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match}]
""",
}


def _documents(task: str) -> list[dict]:
    verses = kjv_verses()[:40]
    if task == "kjv_choice":
        docs = [{"context": " ".join(verses[i:i + 1 + i % 4]), "choices": [v[:30] for v in verses[i + 5:i + 8]],
                 "label": i % 3} for i in range(7)]
        docs.append({"context": "", "choices": ["In the beginning", "And God said"], "label": 0})
        return docs
    if task == "kjv_rolling":
        return [{"text": " ".join(verses[i:i + 1 + 2 * i])} for i in range(4)]
    return [{"context": verses[i][:40 + 10 * i], "answer": verses[i][40 + 10 * i:]} for i in range(3)]


def write_tasks(directory: Path) -> Path:
    for task, body in TASK_YAML.items():
        data = directory / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in _documents(task)))
        (directory / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\n"
            f"test_split: test\n{body}")
    return directory


@pytest.fixture(autouse=True)
def no_bootstrap_pool(monkeypatch):
    """lm-eval bootstraps an error bar (kjv_choice's median) in a pool forked from the process, whose workers
    could hang on a lock one of torch's threads held (two runs did under CI's load): megadiff's runs bootstrap in
    their own process, and so do the harness's reference runs here."""
    def forked(*args, **kwargs):
        raise AssertionError("lm-eval forked a bootstrap pool")
    monkeypatch.setattr(multiprocessing, "Pool", forked)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm_eval")
    return {variant: held_out_run(root, variant)[0] for variant in ("diff", "dint")}


def run_lm_eval(run: Path, tasks: Path, output: Path, batch_size: int = 3, extra: tuple[str, ...] = ()) -> None:
    assert main(["lm-eval", "--load", str(run), "--tasks", *TASKS, "--include-path", str(tasks), "--batch-size",
                 str(batch_size), "--dtype", "fp32", "--output", str(output), "--log-samples", *extra]) == 0


def megadiff_lm_eval(run: Path, tasks: Path, output: Path, batch_size: int = 3, extra: tuple[str, ...] = ()) -> dict:
    run_lm_eval(run, tasks, output, batch_size, extra)
    return json.loads(output.read_text())


def answers(samples: dict) -> dict[tuple[str, int], list]:
    """{(task, doc_id): each request's answer}: a (log-likelihood, greedy) pair, a rolling
    log-likelihood or a generated string, as plain Python values. The first answer of each: with
    several ranks the harness pads the shorter share with a repeat of its last request."""
    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return {(task, sample["doc_id"]): [plain(request[0]) for request in sample["resps"]]
            for task, rows in samples.items() for sample in rows}


def assert_same_answers(ours: dict, theirs: dict, rel: float) -> None:
    """Log-likelihoods within `rel`; greedy flags and generated text equal."""
    assert ours.keys() == theirs.keys()
    for key, answer in theirs.items():
        mine, expected = _leaves(ours[key]), _leaves(answer)
        assert len(mine) == len(expected), (key, ours[key], answer)
        for a, b in zip(mine, expected):
            if isinstance(b, float):
                assert a == pytest.approx(b, rel=rel, abs=rel), (key, ours[key], answer)
            else:
                assert a == b, (key, ours[key], answer)


def _leaves(value) -> list:
    return [leaf for item in value for leaf in _leaves(item)] if isinstance(value, list) else [value]


@pytest.mark.parametrize("variant", ["diff", "dint"])
def test_answers_equal_the_harness_hf_model_on_the_export(runs, tasks, variant, tmp_path):
    ours = megadiff_lm_eval(runs[variant], tasks, tmp_path / "ours.json")
    hf_dir = convert_to_hf(runs[variant], tmp_path / "hf")
    # megadiff never generates the embedding's padding ids (300..383 here, whose logits random
    # weights make as likely as any): neither does the oracle
    padded = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    # batch 1: every request scored on its own, the oracle for our padded batches of 3
    with bootstrap_in_this_process():
        theirs = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "max_length": SEQ_LENGTH,
                                    "trust_remote_code": variant != "diff"},
            tasks=TASKS, batch_size=1, device="cpu", log_samples=True,
            gen_kwargs={"suppress_tokens": list(range(VOCAB_IN_USE, padded))},
            task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False))
    assert_same_answers(answers(ours["samples"]), answers(theirs["samples"]), rel=1e-4)
    for task in TASKS:
        assert ours["results"][task].keys() == theirs["results"][task].keys()
    assert any(answers(ours["samples"])["kjv_generate", i][0] for i in range(3)), "no text was generated"


def test_chat_requests_equal_the_harness_hf_model_on_the_export(tasks, tmp_path, capsys):
    """--apply-chat-template asks a chat-tuned run (data.chat_template) every request as a
    conversation, few-shot examples as turns, as the harness's Hugging Face model asks the export
    (whose tokenizer carries the template)."""
    run, _ = held_out_run(tmp_path / "run", "diff", overrides=("data.messages_key=messages",
                                                               f"data.chat_template={CHATML}"))
    system = "Answer as the scripture does."
    chat = ("--apply-chat-template", "--system-instruction", system, "--fewshot-as-multiturn", "--num-fewshot", "1")
    ours = megadiff_lm_eval(run, tasks, tmp_path / "ours.json", extra=chat)
    assert ours["chat_template"] == Path(CHATML).read_text() and ours["system_instruction"] == system
    contexts = [sample["arguments"][0][0] for sample in ours["samples"]["kjv_generate"]]
    # a run without a template (nor its tokenizer) cannot be asked as a chat
    assert main(["lm-eval", "--load", str(held_out_run(tmp_path / "plain", "diff")[0]), "--tasks", "kjv_choice",
                 "--include-path", str(tasks), "--apply-chat-template"]) == 2
    assert "trained without data.chat_template" in capsys.readouterr().err
    assert all(c.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n") and
               c.count("<|im_start|>assistant\n") == 2 and c.endswith("<|im_start|>assistant\n") for c in contexts)
    hf_dir = convert_to_hf(run, tmp_path / "hf")
    padded = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    with bootstrap_in_this_process():
        theirs = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "max_length": SEQ_LENGTH},
            tasks=TASKS, batch_size=1, device="cpu", log_samples=True, num_fewshot=1, apply_chat_template=True,
            system_instruction=system, fewshot_as_multiturn=True, random_seed=1234, numpy_random_seed=1234,
            torch_random_seed=1234, fewshot_random_seed=1234,
            gen_kwargs={"suppress_tokens": list(range(VOCAB_IN_USE, padded))},
            task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False))
    for task in TASKS:  # the same contexts, word for word
        assert [[request[0] for request in s["arguments"]] for s in ours["samples"][task]] == \
            [[request[0] for request in s["arguments"]] for s in theirs["samples"][task]]
    assert_same_answers(answers(ours["samples"]), answers(theirs["samples"]), rel=1e-4)


def test_a_tokenizer_that_begins_texts_with_a_bos(tasks, tmp_path):
    """A run whose tokenizer puts a BOS before every text (Llama's): a context begins with it, and an
    empty context is conditioned on it, as the harness's Hugging Face model does on the export; a
    rolling text is scored token by token after it (transformers' log-probabilities of the text's own
    tokens: the harness's model would also score a second BOS there). A --cache
    answered before contexts began with it is refused."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tokenizer(tmp_path / "tokenizer", bos="<s>", adds_bos=True)
    run, _ = held_out_run(tmp_path, "diff")
    cache = tmp_path / "cache"
    ours = answers(megadiff_lm_eval(run, tasks, tmp_path / "ours.json", extra=("--cache", str(cache)))["samples"])
    hf_dir = convert_to_hf(run, tmp_path / "hf")
    padded = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    with bootstrap_in_this_process():
        theirs = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "max_length": SEQ_LENGTH},
            tasks=["kjv_choice", "kjv_generate"], batch_size=1, device="cpu", log_samples=True,
            gen_kwargs={"suppress_tokens": list(range(VOCAB_IN_USE, padded))},
            task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False))
    rolling = {key: answer for key, answer in ours.items() if key[0] == "kjv_rolling"}
    assert_same_answers({key: answer for key, answer in ours.items() if key not in rolling},
                        answers(theirs["samples"]), rel=1e-4)
    tokenizer, model = AutoTokenizer.from_pretrained(hf_dir), AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert tokenizer("verse")["input_ids"][0] == tokenizer.bos_token_id == 1
    for index, document in enumerate(_documents("kjv_rolling")):
        tokens = tokenizer(document["text"], add_special_tokens=False)["input_ids"]
        expected = 0.0
        for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                tokens, prefix_token=tokenizer.bos_token_id, max_seq_len=SEQ_LENGTH, context_len=1)):
            window = torch.tensor([(context + continuation)[:-1]])
            with torch.no_grad():
                log_probs = model(window).logits[0, -len(continuation):].float().log_softmax(-1)
            expected += float(log_probs.gather(1, torch.tensor(continuation)[:, None]).sum())
        assert rolling["kjv_rolling", index][0] == pytest.approx(expected, rel=1e-4)
    request = json.loads(Path(f"{cache}.request.json").read_text())
    assert request.pop("text_start") == [1]
    Path(f"{cache}.request.json").write_text(json.dumps(request))  # as recorded before contexts began with it
    assert main(["lm-eval", "--load", str(run), "--tasks", "kjv_choice", "--include-path", str(tasks), "--cache",
                 str(cache), "--dtype", "fp32"]) == 2


def test_special_texts_inside_chat_turns_stay_text_as_in_training(runs):
    """A request rendered as a conversation whose turns hold special tokens' texts (the EOD) is
    encoded as training encodes that conversation: those texts stay text."""
    from megadiff.inference.harness import MegadiffLM
    from megadiff.checkpoint.single_process import load_checkpoint
    from tests.test_inference import MARKUP_MESSAGE, training_prompt

    template = Path(CHATML).read_text()
    lm = MegadiffLM(load_checkpoint(runs["diff"]), chat_template=template)
    turns = [{"role": "system", "content": "Answer <|endoftext|> briefly."},
             {"role": "user", "content": MARKUP_MESSAGE}]
    ids = lm.tok_encode(lm.apply_chat_template(turns))
    assert ids == training_prompt(turns, template, lm.tok) and lm.eot_token_id not in ids


def test_contexts_of_any_length_generate_side_by_side_as_one_at_a_time(runs, tmp_path, monkeypatch):
    """Contexts of 2 to 14 words (the longest cut to the window): their greedy generations run in
    batches (--batch-size 4) whatever their lengths, and answer what batch 1 answers."""
    from megadiff.inference import harness

    verses = kjv_verses()[:24]
    data = tmp_path / "kjv_long.jsonl"
    contexts = [" ".join(" ".join(verses[i:i + 3]).split()[:2 + 3 * (i % 5)]) for i in range(0, 20, 2)]
    data.write_text("".join(json.dumps({"context": context, "answer": verses[i + 4]}) + "\n"
                            for context, i in zip(contexts, range(0, 20, 2))))
    (tmp_path / "kjv_long.yaml").write_text(
        f"task: kjv_long\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        + TASK_YAML["kjv_generate"])
    batches = []
    real_generate_batch = harness.generate_batch

    def watched(model, prompts, *args, **kwargs):
        batches.append([len(prompt) for prompt in prompts])
        return real_generate_batch(model, prompts, *args, **kwargs)

    monkeypatch.setattr(harness, "generate_batch", watched)
    results = {}
    for batch_size in (4, 1):
        output = tmp_path / f"batch{batch_size}.json"
        assert main(["lm-eval", "--load", str(runs["dint"]), "--tasks", "kjv_long", "--include-path", str(tmp_path),
                     "--batch-size", str(batch_size), "--dtype", "fp32", "--output", str(output),
                     "--log-samples"]) == 0
        results[batch_size] = answers(json.loads(output.read_text())["samples"])
        if batch_size == 4:  # 10 requests: 4 + 4 + 2 rows, longest first (cut to the window), one of several lengths
            assert [len(rows) for rows in batches] == [4, 4, 2] and len(set(batches[1])) == 4
            assert [length for rows in batches for length in rows] == sorted(sum(batches, []), reverse=True)
    assert results[4] == results[1] and len(results[1]) == 10
    assert any(answer[0] for answer in results[1].values()), "no text was generated"


def test_sampled_repeats_differ_and_a_seed_gives_them_again(runs, tmp_path):
    """A task sampling 4 answers per document (do_sample, the task's repeats): the repeats decode side
    by side yet draw differently, the same --seed gives the same answers, another seed others."""
    data = tmp_path / "kjv_sample.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in _documents("kjv_generate")))
    (tmp_path / "kjv_sample.yaml").write_text(
        f"task: kjv_sample\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\nrepeats: 4\n"
        "generation_kwargs: {until: ['.'], max_gen_toks: 6, do_sample: true, temperature: 1.0}\n"
        "metric_list: [{metric: exact_match}]\n")

    def sampled(seed: int, name: str) -> list:
        output = tmp_path / f"{name}.json"
        assert main(["lm-eval", "--load", str(runs["dint"]), "--tasks", "kjv_sample", "--include-path", str(tmp_path),
                     "--batch-size", "8", "--dtype", "fp32", "--seed", str(seed), "--output", str(output),
                     "--log-samples"]) == 0
        return [sample["resps"] for sample in json.loads(output.read_text())["samples"]["kjv_sample"]]

    first = sampled(7, "first")
    repeats = [[str(answer) for answer in _leaves(resps)] for resps in first]
    assert [len(answers) for answers in repeats] == [4, 4, 4]
    assert all(len(set(answers)) > 1 for answers in repeats), repeats
    assert sampled(7, "again") == first and sampled(8, "other") != first


def test_a_sampled_answer_is_the_same_whatever_the_batch_the_order_and_the_ranks(runs, monkeypatch):
    """Sampled requests (two repeats each, as the harness passes them: one after the other) answered one
    at a time by one process, then in one batch of 8 with the documents in reverse order, then shared
    between two ranks (each answering every other document, the shorter share padded with its last
    document's repeats once more, as the harness pads it): every request draws the same tokens, as its
    answer depends on --seed and the request alone, and the padding draws what it repeats."""
    from lm_eval.api.instance import Instance
    from megadiff.checkpoint.single_process import load_checkpoint
    from megadiff.inference import harness

    model = load_checkpoint(runs["dint"], torch.float32)
    kwargs = {"until": ["."], "max_gen_toks": 6, "do_sample": True, "temperature": 1.0}
    documents = (_documents("kjv_generate") * 2)[:5]  # the same context in two documents, too
    requests = [Instance("generate_until", doc, (doc["context"], kwargs), 0, ("kjv_sample", doc_id, 2))
                for doc_id, doc in enumerate(documents)]

    def answered(doc_ids: list[int], batch_size: int, rank: int = 0, padded: bool = False) -> dict:
        """{(document, repeat): answer}, and with `padded` ("padding", repeat) the padding's."""
        monkeypatch.setattr(harness, "rank_and_world", lambda: (rank, 2 if rank else 1))
        lm = harness.MegadiffLM(model, batch_size=batch_size, seed=7)
        asked = [(doc_id, repeat) for doc_id in doc_ids for repeat in range(2)]
        asked += [("padding", repeat) for repeat in range(2)] if padded else []
        answers = lm.generate_until([requests[doc_ids[-1] if doc_id == "padding" else doc_id]
                                     for doc_id, _ in asked])
        return dict(zip(asked, answers))

    every = list(range(len(documents)))
    one_at_a_time = answered(every, batch_size=1)
    assert len(set(one_at_a_time.values())) > len(documents), "the repeats drew alike"
    assert answered(every[::-1], batch_size=8) == one_at_a_time
    shares = [answered(every[rank::2], batch_size=3, rank=rank, padded=rank == 1) for rank in range(2)]
    padding = {key: shares[1].pop(key) for key in [("padding", 0), ("padding", 1)]}
    assert {**shares[0], **shares[1]} == one_at_a_time
    assert list(padding.values()) == [one_at_a_time[every[1::2][-1], repeat] for repeat in range(2)]


def test_quantized_attention_logits_reach_every_answer(runs, tasks, tmp_path):
    """--attention-logit-bits (the DIFF paper's Figure 8; the quantization itself is tested against
    the formula in tests/test_ops.py): 16 bits answer as the model does, 3 bits otherwise."""
    plain = answers(megadiff_lm_eval(runs["dint"], tasks, tmp_path / "plain.json")["samples"])
    fine, coarse = (megadiff_lm_eval(runs["dint"], tasks, tmp_path / f"{bits}.json",
                                     extra=("--attention-logit-bits", str(bits))) for bits in (16, 3))
    assert fine["attention_logit_bits"] == 16
    # the drawn weights attend almost uniformly: 3 bits move log-likelihoods by ~2e-4, 16 bits by ~1e-7
    assert_same_answers(answers(fine["samples"]), plain, rel=1e-5)
    with pytest.raises(AssertionError):
        assert_same_answers(answers(coarse["samples"]), plain, rel=5e-5)


def test_generation_settings_override_the_tasks(runs, tasks, tmp_path, monkeypatch):
    """--gen-kwargs max_gen_toks=2 (the task asks for 6): every generation is decoded with a budget
    of 2 new tokens; the other requests answer as without it."""
    from megadiff.inference import harness

    plain = answers(megadiff_lm_eval(runs["dint"], tasks, tmp_path / "plain.json")["samples"])
    budgets = []

    def recording(model, prompts, max_new_tokens, **options):
        budgets.append(max_new_tokens)
        return generate_batch(model, prompts, max_new_tokens, **options)

    generate_batch = harness.generate_batch
    monkeypatch.setattr(harness, "generate_batch", recording)
    short = megadiff_lm_eval(runs["dint"], tasks, tmp_path / "short.json", extra=("--gen-kwargs", "max_gen_toks=2"))
    assert short["gen_kwargs"] == "max_gen_toks=2" and budgets and set(budgets) == {2}
    for key, answer in answers(short["samples"]).items():
        if key[0] != "kjv_generate":
            assert answer == plain[key]


@pytest.mark.parametrize("document_masking", [True, False])
def test_document_masked_checkpoint_never_attends_across_the_prefix(runs, document_masking):
    """The harness conditions a text's first token on an end-of-document prefix; a checkpoint
    trained with data.document_masking then scores the rest of the text as if alone."""
    from megadiff.inference.harness import MegadiffLM
    from megadiff.checkpoint.single_process import CausalLM, load_checkpoint

    loaded = load_checkpoint(runs["diff"], torch.float32)
    data = loaded.cfg.data.model_copy(update={"document_masking": document_masking})
    model = CausalLM(loaded.gpt, loaded.cfg.model_copy(update={"data": data}), loaded.checkpoint_dir)
    text = " ".join(kjv_verses()[:2])[:60]
    tokens = model.tokenizer.encode(text)
    assert 2 < len(tokens) < SEQ_LENGTH
    (got,) = MegadiffLM(model).loglikelihood_rolling([SimpleNamespace(args=(text,))])

    with torch.no_grad():
        first = model(torch.tensor([[model.tokenizer.eod]]))[0, 0].log_softmax(-1)[tokens[0]]
        rest = model(torch.tensor([tokens[:-1]]))[0].log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])
    alone = float(first + rest.sum())
    assert (got == pytest.approx(alone, rel=1e-6)) == document_masking


# where a run fails (the call of a counted kind that raises) and, from an uninterrupted run's
# counts, what its rerun computes: everything not answered before the failure
INTERRUPTIONS = {
    "in its third log-likelihood batch": (("forwards", 3), lambda total: {
        "log-likelihoods": total["log-likelihoods"] - 2 * 2, "generations": total["generations"],
        "rolling texts": total["rolling texts"]}),
    "in its second generation batch": (("generations", 2 + 1), lambda total: {
        "log-likelihoods": 0, "generations": total["generations"] - 2, "rolling texts": total["rolling texts"]}),
    "at its second rolling text": (("rolling texts", 2), lambda total: {
        "log-likelihoods": 0, "generations": 0, "rolling texts": total["rolling texts"] - 1}),
}


@pytest.mark.parametrize("interruption", list(INTERRUPTIONS))
def test_an_interrupted_run_resumes_from_its_cache(runs, tasks, tmp_path, monkeypatch, interruption):
    """--cache keeps every answer as it is computed. The harness asks log-likelihoods (batches of
    2 here), then generations (batches of 2), then rolling log-likelihoods (4 texts): a run that fails, rerun,
    computes only what it had not, and reports what an uninterrupted run does."""
    from megadiff.inference import harness

    computed = dict.fromkeys(("log-likelihoods", "forwards", "generations", "rolling texts"), 0)
    failing = {}

    def counted(kind, real):
        def call(*args, **kwargs):
            computed[kind] += len(args[1]) if kind in ("log-likelihoods", "generations") else 1  # requests
            if (kind, computed[kind]) == failing.get("at"):
                raise RuntimeError("preempted")
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(harness.MegadiffLM, "_loglikelihood_tokens",
                        counted("log-likelihoods", harness.MegadiffLM._loglikelihood_tokens))
    monkeypatch.setattr(harness.CausalLM, "hidden_states", counted("forwards", harness.CausalLM.hidden_states))
    monkeypatch.setattr(harness.MegadiffLM, "_decode", counted("generations", harness.MegadiffLM._decode))
    monkeypatch.setattr(harness, "get_rolling_token_windows",
                        counted("rolling texts", harness.get_rolling_token_windows))
    whole = megadiff_lm_eval(runs["diff"], tasks, tmp_path / "whole.json", batch_size=2)
    failing["at"], recomputed = INTERRUPTIONS[interruption]
    expected = recomputed(dict(computed))
    cache = ("--cache", str(tmp_path / "cache"))
    computed.update(dict.fromkeys(computed, 0))
    with pytest.raises(RuntimeError, match="preempted"):
        run_lm_eval(runs["diff"], tasks, tmp_path / "first.json", batch_size=2, extra=cache)
    assert (tmp_path / "cache_rank0.db").is_file()
    failing.clear()
    computed.update(dict.fromkeys(computed, 0))
    resumed = megadiff_lm_eval(runs["diff"], tasks, tmp_path / "resumed.json", batch_size=2, extra=cache)
    assert {kind: computed[kind] for kind in expected} == expected
    assert_same_answers(answers(resumed["samples"]), answers(whole["samples"]), rel=1e-6)


def test_a_cache_answers_only_the_request_it_was_kept_for(runs, tasks, tmp_path, capsys, monkeypatch):
    """The harness keys a --cache's answers on the requests' text alone: a rerun with the same options
    takes them, one whose answers would differ (another dtype, attention logits in fewer bits) is
    refused rather than given the first run's. A cache kept before requests were recorded is taken
    as the rerun's request, which is recorded from then on."""
    from megadiff.inference import harness

    cache = tmp_path / "cache"
    forwards = []
    hidden_states = harness.CausalLM.hidden_states
    monkeypatch.setattr(harness.CausalLM, "hidden_states",
                        lambda model, *args: forwards.append(1) or hidden_states(model, *args))

    def lm_eval(name: str, *options: str) -> int:
        return main(["lm-eval", "--load", str(runs["diff"]), "--tasks", "kjv_choice", "--include-path", str(tasks),
                     "--limit", "2", "--output", str(tmp_path / f"{name}.json"), "--log-samples", "--cache", str(cache),
                     "--dtype", "fp32", *options])

    def samples(name: str) -> dict:
        return answers(json.loads((tmp_path / f"{name}.json").read_text())["samples"])

    assert lm_eval("first") == 0 and forwards
    forwards.clear()
    assert lm_eval("again") == 0
    assert samples("again") == samples("first") and not forwards  # every answer from the cache
    capsys.readouterr()
    for option, differing in ((("--dtype", "bf16"), "torch.bfloat16"), (("--attention-logit-bits", "3"), "3 here")):
        assert lm_eval("other", *option) == 2
        refusal = capsys.readouterr().err
        assert f"--cache {cache} holds the answers of another request" in refusal, refusal
        assert option[0] in refusal and differing in refusal and "give this one another --cache" in refusal
    assert not forwards and not (tmp_path / "other.json").exists()

    Path(f"{cache}.request.json").unlink()  # as kept before requests were recorded
    assert lm_eval("unrecorded") == 0 and not forwards
    assert "taken as this request's" in capsys.readouterr().out
    assert lm_eval("other", "--dtype", "bf16") == 2


def _ranks_lm_eval(rank: int, world_size: int, run: str, tasks: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megadiff.inference import harness

    counts, check_task_data = {"group_at_the_data_check": []}, harness.check_task_data

    def in_a_group(*args):  # the ranks read the tasks' data as one group decides (the hub's or the cache's)
        counts["group_at_the_data_check"].append(dist.get_world_size() if dist.is_initialized() else None)
        return check_task_data(*args)

    with counting_sequences(counts, "lm-eval"), mock.patch.object(harness, "check_task_data", in_a_group):
        # with a fresh --cache: its request, checked by every rank, is recorded by rank 0 alone
        run_lm_eval(Path(run), Path(tasks), Path(out_dir) / "results.json", batch_size=2,
                    extra=("--cache", str(Path(out_dir) / "cache")))
    Path(out_dir, f"counts{rank}.json").write_text(json.dumps(counts))


def test_two_ranks_share_the_requests_and_report_what_one_process_reports(runs, tasks, tmp_path, capfd):
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    run_ranks(2, _ranks_lm_eval, str(runs["dint"]), str(tasks), str(tmp_path / "two"))
    rank0, _, rank1 = capfd.readouterr().err.partition("----- rank 1 -----")
    # rank 0 prints the table, and the bars of its share at both ranks' rate
    assert "|kjv_choice" in rank0 and "|kjv_choice" not in rank1
    for bar in ("lm-eval log-likelihoods", "lm-eval rolling log-likelihoods", "lm-eval generations"):
        assert bar in rank0 and bar not in rank1, bar
    assert "tokens/s on 2 ranks" in rank0
    _ranks_lm_eval(0, 1, str(runs["dint"]), str(tasks), str(tmp_path / "one"))

    one, two = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
    requests = [(tmp_path / name / "cache.request.json").read_text() for name in ("one", "two")]
    assert requests[0] == requests[1]
    assert_same_answers(answers(two["samples"]), answers(one["samples"]), rel=1e-5)
    for task in TASKS:  # listed in the order of one process, and the error bars bootstrapped over it alike
        assert [sample["doc_id"] for sample in two["samples"][task]] == [
            sample["doc_id"] for sample in one["samples"][task]], task
        for metric, value in one["results"][task].items():
            if isinstance(value, float):
                assert two["results"][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-7), (task, metric)
    # each rank ran its share of the sequences (the harness pads the shorter share with repeats)
    counts = [json.loads((tmp_path / "two" / f"counts{rank}.json").read_text()) for rank in range(2)]
    assert [count["group_at_the_data_check"] for count in counts] == [[2], [2]]
    shares = [count["lm-eval"] for count in counts]
    alone = json.loads((tmp_path / "one" / "counts0.json").read_text())["lm-eval"]
    assert all(0 < count < alone for count in shares) and sum(shares) >= alone


def _ranks_few_shot(rank: int, world_size: int, run: str, tasks: str, output: str) -> None:
    assert main(["lm-eval", "--load", run, "--tasks", "kjv_choice", "--include-path", tasks, "--num-fewshot", "2",
                 "--dtype", "fp32", "--output", output, "--log-samples"]) == 0


def test_two_ranks_show_each_document_the_few_shot_examples_one_process_shows_it(runs, tasks, tmp_path):
    """--num-fewshot 2 on two ranks: lm-eval draws the examples from one generator, a document after another,
    over a rank's documents; every document's context (and so its answers and the scores) is still the one
    one process gives it."""
    run_ranks(2, _ranks_few_shot, str(runs["diff"]), str(tasks), str(tmp_path / "two.json"))
    _ranks_few_shot(0, 1, str(runs["diff"]), str(tasks), str(tmp_path / "one.json"))
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))

    def contexts(report: dict) -> dict[int, str]:
        return {sample["doc_id"]: sample["arguments"]["gen_args_0"]["arg_0"] if isinstance(sample["arguments"], dict)
                else sample["arguments"][0][0] for sample in report["samples"]["kjv_choice"]}

    assert contexts(two) == contexts(one)
    assert_same_answers(answers(two["samples"]), answers(one["samples"]), rel=1e-5)
    assert two["results"]["kjv_choice"]["acc,none"] == one["results"]["kjv_choice"]["acc,none"]


def test_mistakes_are_refused_before_the_checkpoint_is_read(tasks, tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "no-run")
    assert main(["lm-eval", "--load", missing, "--tasks", "no_such_task", "--include-path", str(tasks)]) == 2
    assert "no_such_task" in capsys.readouterr().err
    task_file = next(tasks.glob("*.yaml"))  # a task's file, not their directory: the harness ignored it
    assert main(["lm-eval", "--load", missing, "--tasks", "kjv_choice", "--include-path", str(task_file)]) == 2
    assert f"--include-path {task_file} is no directory" in capsys.readouterr().err
    assert main(["lm-eval", "--load", missing, "--tasks", "kjv_choice", "--log-samples"]) == 2
    assert "--output" in capsys.readouterr().err
    assert main(["lm-eval", "--load", missing, "--tasks", "kjv_choice", "--fewshot-as-multiturn"]) == 2
    assert "add --apply-chat-template" in capsys.readouterr().err
    from megadiff.inference import harness
    # local tasks alone skip indexing the harness's own; mixed with those, both are found
    assert harness.known_tasks(["kjv_*"], str(tasks))[1] == sorted(TASKS)
    assert harness.known_tasks(["kjv_choice", "hellaswag"], str(tasks))[1] == ["hellaswag", "kjv_choice"]
    # a task whose data cannot be read: named, before the checkpoint (no-run) is looked for
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "kjv_gone.yaml").write_text(
        (tasks / "kjv_choice.yaml").read_text().replace("kjv_choice", "kjv_gone").replace(str(tasks), str(tmp_path)))
    assert main(["lm-eval", "--load", missing, "--tasks", "kjv_gone", "--include-path", str(tmp_path / "gone")]) == 2
    assert "lm-eval cannot read the data of the tasks ['kjv_gone']" in capsys.readouterr().err
    monkeypatch.setattr(harness, "HARNESS_MISSING", True)
    assert main(["lm-eval", "--load", missing, "--tasks", "kjv_choice"]) == 3
    assert "pip install" in capsys.readouterr().err


class _UnavailableHub(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 -- http.server's name
        self.send_response(503)
        self.end_headers()


@pytest.mark.parametrize("hub", ["answers", "answers 503", "does not answer"])
def test_an_unreachable_hub_reads_task_data_from_the_cache_without_retrying(tasks, hub, capsys, monkeypatch):
    """Without HF_HUB_OFFLINE, datasets retries an unreachable hub for some 20 s a task: one request
    without an answer turns offline mode on instead; a hub that answers, whatever its status, leaves it off."""
    import datasets
    import huggingface_hub
    from megadiff.inference import harness

    handler = _UnavailableHub if hub == "answers 503" else http.server.SimpleHTTPRequestHandler
    with socketserver.TCPServer(("127.0.0.1", 0), handler) as server:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        if hub == "does not answer":
            server.server_close()  # nothing listens there: the connection is refused
        else:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        manager, names = harness.known_tasks(["kjv_choice"], str(tasks))
        harness.check_task_data(manager, names)  # the task's data is local: read either way
        if hub != "does not answer":
            server.shutdown()
    offline = hub == "does not answer"
    assert datasets.config.HF_HUB_OFFLINE is huggingface_hub.constants.HF_HUB_OFFLINE is offline
    assert ("does not answer" in capsys.readouterr().err) is offline


def _ranks_probe_the_hub(rank: int, world_size: int, endpoints: list[str], out_dir: str,
                         offline_ranks: tuple[int, ...] = ()) -> None:
    from datetime import timedelta

    import datasets
    import huggingface_hub
    from megadiff.inference import harness
    from megadiff.parallel import init_process_group

    huggingface_hub.constants.ENDPOINT = endpoints[rank]
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = rank in offline_ranks
    init_process_group(timedelta(minutes=2))
    harness.read_hub_data_from_cache_if_unreachable()
    Path(out_dir, f"offline{rank}.json").write_text(
        json.dumps([datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE]))


@pytest.mark.parametrize("answering_rank", [0, 1])
def test_every_rank_takes_rank_0s_answer_from_the_hub(answering_rank, tmp_path, capfd):
    """Ranks that decided apart could read different revisions of a task's data: where the hub answers rank 0
    alone, no rank goes offline; where it answers rank 1 alone, every rank does."""
    with socketserver.TCPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler) as server, \
            socketserver.TCPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler) as silent:
        silent.server_close()  # nothing listens there: the connection is refused
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoints = [f"http://127.0.0.1:{s.server_address[1]}" for s in (silent, silent)]
        endpoints[answering_rank] = f"http://127.0.0.1:{server.server_address[1]}"
        run_ranks(2, _ranks_probe_the_hub, endpoints, str(tmp_path))
        server.shutdown()
    offline = answering_rank != 0
    for rank in range(2):
        assert json.loads((tmp_path / f"offline{rank}.json").read_text()) == [offline, offline], rank
    rank0, _, rank1 = capfd.readouterr().err.partition("----- rank 1 -----")
    assert ("does not answer" in rank0) is offline and "does not answer" not in rank1


def test_a_rank_offline_by_its_own_setting_takes_every_rank_offline(tmp_path, capfd):
    """HF_HUB_OFFLINE=1 on one node only: that rank skipped the collective the others joined (their next
    collectives then paired with the wrong calls) and read the cache where the others read the hub."""
    with socketserver.TCPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        run_ranks(2, _ranks_probe_the_hub, [endpoint, endpoint], str(tmp_path), (1,))
        server.shutdown()
    for rank in range(2):
        assert json.loads((tmp_path / f"offline{rank}.json").read_text()) == [True, True], rank
    assert "HF_HUB_OFFLINE=1 on ranks [1] alone: the tasks' data is read from the datasets cache only" in \
        capfd.readouterr().err


def document_masked(run: Path):
    from megadiff.checkpoint.single_process import CausalLM, load_checkpoint

    loaded = load_checkpoint(run, torch.float32)
    data = loaded.cfg.data.model_copy(update={"document_masking": True})
    return CausalLM(loaded.gpt, loaded.cfg.model_copy(update={"data": data}), loaded.checkpoint_dir)


def test_a_document_masked_checkpoint_generates_what_its_scores_call_greedy(runs):
    """An empty context (the end-of-document prefix alone): the generated ids are the ones the
    harness's own log-likelihood calls greedy, attention kept within documents in both."""
    from megadiff.inference.harness import MegadiffLM

    lm = MegadiffLM(document_masked(runs["diff"]))
    (plan,) = plans = [lm._plan("", {"until": ["@@@"], "max_gen_toks": 6, "do_sample": False})]
    (new,) = lm._decode(plans, [torch.Generator()])
    assert plan.prompt == [lm.eot_token_id] and len(new) > 1
    assert lm.score([(plan.prompt, new)])[0][1]


def test_a_context_of_whitespace_alone_is_scored_as_the_empty_context(runs):
    """The harness moves a context's trailing whitespace onto the continuation: a context of whitespace alone
    then encodes to no tokens (this tokenizer begins texts with no BOS), and is conditioned, as the empty
    context is, on the prefix token: (" ", "In the beginning") scores as ("", " In the beginning")."""
    from lm_eval.api.instance import Instance
    from megadiff.checkpoint.single_process import load_checkpoint
    from megadiff.inference.harness import MegadiffLM

    lm = MegadiffLM(load_checkpoint(runs["diff"], torch.float32), batch_size=2)
    assert not lm.tok.text_start

    def scored(pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        return lm.loglikelihood([Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)])

    whitespace = scored([(" ", "In the beginning"), ("\n", "And God said"), (" ", "I")])
    empty = scored([("", " In the beginning"), ("", "\nAnd God said"), ("", " I")])
    assert [greedy for _, greedy in whitespace] == [greedy for _, greedy in empty]
    assert [score for score, _ in whitespace] == pytest.approx([score for score, _ in empty], rel=1e-5)


def test_generation_kwargs_of_null_are_the_defaults_and_a_top_k_of_minus_one_is_off():
    """None (a task's YAML null) leaves a kwarg to its default, and vLLM's top_k=-1 means every id, in
    greedy and sampled decoding alike; other negative top_k and a top_p of 0 are still refused."""
    from megadiff.inference.harness import generation_settings

    greedy = generation_settings({"do_sample": False, "top_k": -1, "top_p": None, "temperature": None}, 6, SEQ_LENGTH)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, 0, 1.0)
    sampled = generation_settings({"do_sample": True, "temperature": 0.7, "top_k": -1, "top_p": None}, 6, SEQ_LENGTH)
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (0.7, 0, 1.0)
    assert generation_settings({"top_k": 5, "top_p": 0.9, "max_gen_toks": None}, 6, SEQ_LENGTH)["max_gen_toks"] == 6
    for kwargs, message in (({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p")):
        with pytest.raises(ConfigError, match=message):
            generation_settings(kwargs, 6, SEQ_LENGTH)


def test_generation_follows_top_p_and_refuses_what_it_cannot_do(runs, tasks, tmp_path, monkeypatch):
    """A nucleus of one id (top_p=1e-9) samples the greedy answer; a kwarg generation would ignore
    is refused, and --gen-kwargs asking so (or more tokens than the window) before the checkpoint is read."""
    from megadiff.inference import harness
    from megadiff.checkpoint.single_process import load_checkpoint

    from lm_eval.api.instance import Instance

    lm = harness.MegadiffLM(load_checkpoint(runs["diff"], torch.float32), max_gen_toks=6)
    context = "In the beginning God created"
    greedy = lm.generate_until([Instance("generate_until", {}, (context, {"until": ["@@"], "do_sample": False}), 0)])
    nucleus = {"until": ["@@"], "do_sample": True, "temperature": 1.0, "top_p": 1e-9}
    assert lm.generate_until([Instance("generate_until", {}, (context, nucleus), 0)] * 3) == greedy * 3
    assert lm._plan(context, {"num_beams": 1, "do_sample": False}).max_new == 6
    for kwargs, message in (({"num_beams": 4}, "num_beams"), ({"min_p": 0.1}, "min_p"),
                            ({"do_sample": True, "temperature": 1.0, "top_p": 0.0}, "top_p")):
        with pytest.raises(ConfigError, match=message):
            lm._plan(context, kwargs)
    monkeypatch.setattr(harness, "load_checkpoint", lambda *args: pytest.fail("the checkpoint was read"))
    for gen_kwargs, message in (("num_beams=4", "num_beams"), (f"max_gen_toks={SEQ_LENGTH}", "window")):
        assert main(["lm-eval", "--load", str(runs["diff"]), "--tasks", "kjv_generate", "--include-path", str(tasks),
                     "--gen-kwargs", gen_kwargs]) == 2


class LinearModel:
    """What MegadiffLM.score() calls of a CausalLM: random decoder states and a linear output layer
    that counts the positions each of its calls forms logits for."""

    def __init__(self, window: int, vocab: int = 50, width: int = 8):
        self.cfg = SimpleNamespace(model=SimpleNamespace(seq_length=window),
                                   data=SimpleNamespace(document_masking=False))
        self.tokenizer, self.device = SimpleNamespace(eod=0), torch.device("cpu")
        self.weight = torch.randn(vocab, width, generator=torch.Generator().manual_seed(0))
        self.calls: list[int] = []

    def hidden_states(self, ids: torch.Tensor, document_eod=None) -> torch.Tensor:
        return torch.randn(ids.shape[1], ids.shape[0], self.weight.shape[1], generator=torch.Generator().manual_seed(1))

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0] * hidden.shape[1])
        return hidden @ self.weight.T


def test_a_long_continuation_is_scored_a_chunk_of_logits_at_a_time():
    """A rolling window's continuation is the whole window: its logits are formed LOSS_CHUNK_TOKENS
    positions at a time (a 64K window's at once would take some 66 GB), and sum to the same answer."""
    from megadiff.inference.harness import MegadiffLM
    from megadiff.checkpoint.single_process import LOSS_CHUNK_TOKENS

    length = 2 * LOSS_CHUNK_TOKENS + 100
    model = LinearModel(window=length + 10)
    continuation = torch.randint(1, 50, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    ((log_likelihood, greedy),) = MegadiffLM(model, batch_size=1).score([([0, 7, 3], continuation)])
    assert max(model.calls) <= LOSS_CHUNK_TOKENS and sum(model.calls) == length

    hidden = model.hidden_states(torch.zeros(1, length + 2))[-length:, 0]
    log_probs = (hidden @ model.weight.T).log_softmax(-1)
    target = torch.tensor(continuation)
    assert log_likelihood == pytest.approx(float(log_probs.gather(1, target[:, None]).sum()), rel=1e-6)
    assert greedy == bool((log_probs.argmax(-1) == target).all())
