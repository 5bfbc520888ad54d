"""Supervised fine-tuning on conversations (data.messages_key): the loss on the assistant's turns.

A record's messages, a list of {"role", "content", ...} (the chat format of Hugging Face and
OpenAI), are rendered by a Jinja chat template (data.chat_template, else the tokenizer's own)
into one document, followed by the EOD. The loss is kept on what the template writes for each
assistant message, from after its generation prompt (e.g. "<|im_start|>assistant\\n") through
its end (e.g. "<|im_end|>\\n"), and on the EOD of a conversation that ends with one.

A template that marks the assistant's text with {% generation %} blocks says where it is itself.
Otherwise an assistant message's text is what rendering the conversation through it adds to
rendering the conversation before it with the generation prompt (the prefix rule TRL uses too),
which holds for templates that render a turn alike whatever follows it; a template that does not
is refused, naming the message. The conversation is encoded as one text, as a chat prompt (and Hugging
Face's apply_chat_template) encodes it; a token takes the loss where its characters overlap the
assistant's text (a tokenizer without character offsets, a slow one, encodes piece by piece). A Hugging
Face tokenizer reads the special tokens the template writes (<|im_start|>, the EOS) as special ids, while
a special token's text inside a message stays text, as in documents (tiktoken's encodings alike).
"""
from __future__ import annotations

import json
import re
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Optional

from megadiff.data.errors import DataError
from megadiff.data.tokenizers import Tokenizer, document_start, encode_continuing, encode_continuing_with_offsets

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# a {% generation %} or {% endgeneration %} tag, its whitespace control on either side
GENERATION_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "function_call": "assistant",
                  "observation": "tool"}
# the roles chat templates know (OpenAI's and Hugging Face's): the loss is on "assistant" turns alone
ROLES = {"system", "developer", "user", "assistant", "tool", "function", "ipython"}
# what a template is rendered on when it is chosen, so a broken one fails before any tokenizing
PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
# a reply whose end of turn is looked for
REPLY = "megadiff-reply"
PROBE_REPLY = [{"role": "user", "content": "u"}, {"role": "assistant", "content": REPLY}]
# wrap a special token's text inside a message while the conversation is rendered, so that it can
# be told apart from the template's own special tokens (Unicode noncharacters: never in text)
LITERAL_OPEN, LITERAL_CLOSE = "\ufdd0", "\ufdd1"
LITERAL = re.compile(f"{LITERAL_OPEN}(.*?){LITERAL_CLOSE}", re.DOTALL)
# written where a template's {% generation %} blocks open and close, to find the assistant's text by (noncharacters)
SPAN_OPEN, SPAN_CLOSE = "\ufdd2", "\ufdd3"
SPAN = re.compile(f"{SPAN_OPEN}([^{SPAN_OPEN}{SPAN_CLOSE}]*){SPAN_CLOSE}")


def chat_template_of(data, tokenizer: Tokenizer) -> Optional[str]:
    """The chat template a run's conversations are rendered with: data.chat_template (opening with the
    tokenizer's document start where it writes none), else the tokenizer's own (None without either)."""
    if data.chat_template is None:
        return tokenizer.chat_template
    return _opening_with_document_start(data.chat_template, tokenizer)


def _opening_with_document_start(template: str, tokenizer: Tokenizer) -> str:
    """`template`, writing the tokenizer's document start (Llama's BOS) first where it writes none: a model
    read every pre-training document after it, and open-instruct's trainer puts it before each Tulu
    conversation (its tokenizer(text)). Written in the template, the export's apply_chat_template gives it too."""
    start = document_start(tokenizer)
    opening = tokenizer.decode(start)
    if not start or tokenizer.encode(opening) != start:
        return template
    for probe in (PROBE, PROBE_REPLY):  # some templates refuse a system turn
        try:
            rendered = render_conversation(probe, template, tokenizer.special_tokens)
        except DataError:
            continue
        return template if encode_piece(rendered, tokenizer)[:len(start)] == start else \
            f"{{{{ {json.dumps(opening)} }}}}" + template
    return template  # one that renders nothing is refused by resolve_chat_template, naming its error


def resolve_chat_template(data, tokenizer: Tokenizer) -> Optional[str]:
    """The template data.messages_key's records are rendered with (None for other data), checked
    on a short conversation."""
    if data.messages_key is None:
        return None
    template = chat_template_of(data, tokenizer)
    if template is None:
        raise DataError(f"data.messages_key: tokenizer {tokenizer.name!r} has no chat template; set "
                        "data.chat_template to a Jinja template or a file holding one (e.g. configs/chat/chatml.jinja)")
    try:
        conversation_pieces(PROBE, template, tokenizer.special_tokens)
    except DataError as with_system:
        try:  # some templates refuse a system turn (Gemma's): a conversation without one must do
            conversation_pieces(PROBE_REPLY, template, tokenizer.special_tokens)
        except DataError:
            raise with_system from None
    _warn_of_an_unlearned_turn_end(template, tokenizer.special_tokens)
    _warn_of_a_learned_turn_header(template, tokenizer.special_tokens)
    return template


def save_chat_template(data, tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write data.chat_template, as conversations were rendered with it, into an exported tokenizer
    (transformers reads chat_template.jinja), so the model is chatted with as it was trained; a tokenizer's
    own template is saved with it."""
    if data.chat_template is not None:
        (Path(directory) / "chat_template.jinja").write_text(chat_template_of(data, tokenizer), encoding="utf-8")


def render_conversation(messages: list[dict], template: str, variables: dict, generation_prompt: bool = False,
                        continue_final: bool = False) -> str:
    """The template's text of `messages`: then the assistant's generation prompt, or with
    `continue_final` the last message left open, for the model to go on with it."""
    return _render(messages, template, variables, generation_prompt, continue_final=continue_final)


def turn_end(template: str, variables: dict) -> Optional[str]:
    """The text the template closes an assistant's turn with (ChatML: "<|im_end|>"), where it
    writes one after the content: where a chat model's reply ends (inside a {% generation %} block
    or after it)."""
    text = _render(PROBE_REPLY, template, variables)
    end = text[text.index(REPLY) + len(REPLY):].strip() if REPLY in text else ""
    return end or None


def turn_end_id(template: str, tokenizer: Tokenizer) -> Optional[int]:
    """The id of turn_end's text where it is one token (ChatML's <|im_end|>, a special token): what an
    exported model's generation stops at besides the EOD, as megadiff's chat stops at the text."""
    end = turn_end(template, tokenizer.special_tokens)
    ids = encode_piece(end, tokenizer) if end is not None else []
    return ids[0] if len(ids) == 1 else None


def stop_ids(eos, template: Optional[str], tokenizer: Tokenizer):
    """A generation config's eos_token_id (an id, a list of them, or None) with the template's end of turn
    added where it is one other token: transformers' generate() stops there, as megadiff's chat does, not
    running on into made-up turns."""
    end = turn_end_id(template, tokenizer) if template is not None else None
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if end is None or end in ids:
        return eos
    return [*ids, end] if ids else end


def _learned_reply_text(template: str, variables: dict) -> str:
    """The text the loss is on when PROBE_REPLY is rendered: what the model learns to write as a reply."""
    return "".join(piece for piece, mine in conversation_pieces(PROBE_REPLY, template, variables) if mine)


def _warn_of_an_unlearned_turn_end(template: str, variables: dict) -> None:
    """A {% generation %} block holding the content alone leaves the loss off the turn's end: the model is
    never taught to end its replies."""
    end = turn_end(template, variables) if GENERATION_BLOCK.search(template) else None
    assistant = _learned_reply_text(template, variables)
    if end is not None and end not in assistant:
        warnings.warn(f"data.chat_template: its {{% generation %}} block leaves out {end!r}, which ends the "
                      "assistant's turn: the model is not trained to end its replies (put it inside the block)",
                      stacklevel=3)


def _warn_of_a_learned_turn_header(template: str, variables: dict) -> None:
    """A template without a generation prompt (ChatML without its add_generation_prompt branch) writes the
    assistant's turn header inside the assistant's text: the model is trained to write it, and a chat prompt
    ends before it."""
    if GENERATION_BLOCK.search(template) or render_conversation(PROBE_REPLY[:1], template, variables, True) != \
            render_conversation(PROBE_REPLY[:1], template, variables):
        return
    assistant = _learned_reply_text(template, variables)
    header = assistant[:assistant.find(REPLY)].strip()
    if header:
        warnings.warn(f"data.chat_template: it writes no generation prompt, so {header!r}, which it writes before "
                      "each assistant message, is trained on as the assistant's text and chat prompts end "
                      "before it (give it an {% if add_generation_prompt %} branch that writes it)", stacklevel=3)


def _render(messages: list[dict], template: str, variables: dict, generation_prompt: bool = False,
            continue_final: bool = False) -> str:
    """The rendered text of `messages`."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=generation_prompt,
                                            continue_final_message=continue_final, **variables)
    except Exception as err:  # jinja's syntax and undefined-variable errors, the template's raise_exception
        raise DataError(f"data.chat_template: the template fails on the messages {str(messages)[:120]}: "
                        f"{type(err).__name__}: {err}") from err
    return rendered[0]


def _with_span_marks(template: str) -> str:
    """`template` writing SPAN_OPEN and SPAN_CLOSE where its {% generation %} blocks open and close. Each tag
    becomes a block of its own that keeps the tag's whitespace control, so the text around is trimmed alike."""
    def marks(tag: re.Match) -> str:
        trim_before, end, trim_after = tag.groups()
        return f"{{%{trim_before} if true %}}{SPAN_CLOSE if end else SPAN_OPEN}{{% endif {trim_after}%}}"

    return GENERATION_TAG.sub(marks, template)


def _generation_spans(messages: list[dict], template: str, variables: dict) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character ranges of its {% generation %} blocks, found by the marks the blocks
    write. transformers' return_assistant_tokens_mask counts the characters rendered before a block as it runs,
    which leaves out the output Jinja holds back (a macro's, a {% filter %}'s, a {% set %} block's until it is
    written): a block in one got the range of earlier text, and the loss fell on the turn's header."""
    text = _render(messages, template, variables)
    marked = _render(messages, _with_span_marks(template), variables)
    spans, pieces, start = [], [], 0
    for block in SPAN.finditer(marked):
        pieces.append(marked[start:block.start()])
        begin = sum(map(len, pieces))
        spans.append((begin, begin + len(block.group(1))))
        pieces.append(block.group(1))
        start = block.end()
    pieces.append(marked[start:])
    if "".join(pieces) != text:  # a filter changed the text next to a mark, or blocks nest
        raise DataError("data.chat_template: its {% generation %} blocks cannot be located in the rendered text of "
                        f"{str(messages)[:120]!r} (a filter over them, or nested blocks); write them where their "
                        "text is output as it is")
    return text, spans


def _refuse_contents_written_as_python(messages: list[dict], text: str, template: str, variables: dict) -> None:
    """A content that is no text, null or OpenAI's list of parts, which the template (Tulu's, SmolLM2's) wrote as
    Python writes it: the model was trained on "None" or "[{'type': 'text', ...}]" without a word. Templates that
    handle them (a tool call's null content, Llama 3's parts) write no such text and pass."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if content is None and "content" in message:
            emptied = [*messages[:index], {**message, "content": ""}, *messages[index + 1:]]
            written = text.count("None") > _render(emptied, template, variables).count("None")
        else:
            written = isinstance(content, (list, dict)) and str(content) in text
        if written:
            raise DataError(f"data.messages_key: message {index} ({message['role']}) of {str(messages)[:120]!r} "
                            f"holds {type(content).__name__} content, which the chat template writes as the text "
                            f"{str(content)[:60]!r}; give each message's content as a string (a list of parts' "
                            "texts joined), or use a template that handles such content")


def _assistant_spans(messages: list[dict], template: str, variables: dict) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character ranges of the assistant's turns in it."""
    if GENERATION_BLOCK.search(template):
        text, spans = _generation_spans(messages, template, variables)
        _refuse_contents_written_as_python(messages, text, template, variables)
        return text, spans
    text = _render(messages, template, variables)
    _refuse_contents_written_as_python(messages, text, template, variables)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _text_before_reply(messages, index, template, variables)
        through = _render(messages[:index + 1], template, variables)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"data.chat_template: the template renders the turns before message {index} (an "
                            "assistant's) differently once it follows, so its text cannot be told apart; mark the "
                            "assistant's text with {% generation %} ... {% endgeneration %} in the template")
        spans.append((len(before), len(through)))
    return text, spans


def _text_before_reply(messages: list[dict], index: int, template: str, variables: dict) -> str:
    """Where assistant message `index`'s text begins: the turns before it rendered with the generation prompt.
    A conversation opening with the assistant (a greeting) has no turns before it, which templates reading
    messages[0] (Qwen's, Gemma's: "list object has no element 0") cannot render; there, what the template
    writes before a lone assistant reply's content, as it writes a generation prompt."""
    try:
        return _render(messages[:index], template, variables, generation_prompt=True)
    except DataError:
        if index:
            raise
        opened = _render([{"role": "assistant", "content": REPLY}], template, variables)
        if REPLY not in opened:
            raise
        return opened[:opened.index(REPLY)]


def as_messages(conversation) -> list[dict]:
    """A record's conversation as chat templates read it: ShareGPT's {"from", "value"} turns (e.g.
    OpenHermes-2.5, the Dex paper's instruction data) become {"role", "content"} messages."""
    messages = None
    if isinstance(conversation, list) and all(isinstance(m, dict) for m in conversation):
        messages = [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
                    if "from" in m and "role" not in m else m for m in map(_without_filled_in_nulls, conversation)]
    if messages is None or not all(isinstance(m.get("role"), str) for m in messages):
        raise DataError(f"data.messages_key: a record's messages must be a list of {{\"role\": ..., \"content\": "
                        f"...}} (or ShareGPT's {{\"from\": ..., \"value\": ...}}) objects, found "
                        f"{str(conversation)[:120]!r}")
    unknown = sorted({m["role"] for m in messages} - ROLES)
    if unknown:  # "Assistant" or ShareGPT's "chatgpt" would silently take no loss
        raise DataError(f"data.messages_key: unknown role {unknown[0]!r} in {str(conversation)[:120]!r}; the roles "
                        f"are {sorted(ROLES)} (ShareGPT's from: {sorted(SHAREGPT_ROLES)})")
    return messages


def _without_filled_in_nulls(message: dict) -> dict:
    """`message` without its null fields but its content (a tool call's null content is its own). A parquet
    source's messages hold every field any message of the file has, null where one has none ("tool_calls" on
    every plain reply), which templates asking `'tool_calls' in message` (Llama 3.1's) took for a tool call and
    failed on; TRL drops them alike (remove_none_values)."""
    return {key: _without_nulls(value) for key, value in message.items() if value is not None or key == "content"}


def _without_nulls(value):
    """`value` with the null entries of its dicts left out, at any depth (a tool call's fields)."""
    if isinstance(value, dict):
        return {key: _without_nulls(entry) for key, entry in value.items() if entry is not None}
    if isinstance(value, list):
        return [_without_nulls(entry) for entry in value]
    return value


def conversation_pieces(messages: list[dict], template: str, variables: dict) -> list[tuple[str, bool]]:
    """The rendered `{role, content}` messages as consecutive (text, whether it is the assistant's) pieces."""
    text, spans = _assistant_spans(messages, template, variables)
    pieces, start = [], 0
    for begin, end in spans:
        pieces += [(text[start:begin], False), (text[begin:end], True)]
        start = end
    pieces.append((text[start:], False))
    return [(piece, assistant) for piece, assistant in pieces if piece]


def encode_conversation(messages: Optional[list[dict]], template: str, tokenizer: Tokenizer) -> tuple[list[int],
                                                                                                    list[int]]:
    """(token ids, loss mask) of a conversation and its EOD; empty for one without assistant text
    (it would teach nothing) or without messages."""
    if not messages:
        return [], []
    messages = as_messages(messages)
    marked = mark_special_texts(messages, tokenizer.special_texts)
    try:
        ids, mask = _encode_whole(*_assistant_spans(marked, template, tokenizer.special_tokens), tokenizer)
    except NotImplementedError:
        ids, mask = [], []
        for text, assistant in conversation_pieces(marked, template, tokenizer.special_tokens):
            piece = encode_piece(text, tokenizer)
            ids += piece
            mask += [int(assistant)] * len(piece)
    if not any(mask):
        return [], []
    return ids + [tokenizer.eod], no_loss_on_the_first(mask + [int(messages[-1]["role"] == "assistant")])


def no_loss_on_the_first(mask: list[int]) -> list[int]:
    """Packed, a document's first token is the label of the document before it (of its EOD): that document is
    no context for it. Without a start token (tiktoken's) an empty prompt's response, a short prompt's token
    merged with the response's first characters, or an assistant's opening turn a template writes nothing
    before began with a loss."""
    return [0] + mask[1:]


def _encode_whole(text: str, spans: list[tuple[int, int]], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The rendered conversation's ids, as encode_piece gives them, and whether each token's characters
    overlap an assistant's span."""
    def assistant(start: int, end: int) -> bool:
        return any(begin < end and start < stop if start < end else begin <= start < stop for begin, stop in spans)

    ids: list[int] = []
    mask: list[int] = []
    for position, chunk, literal in _chunks(text):
        # a chunk after a message's special-token text goes on from it (SentencePiece would begin it with a space)
        chunk_ids, offsets = encode_continuing_with_offsets(tokenizer, chunk, literal) if position else \
            tokenizer.encode_with_offsets(chunk, ordinary=literal)
        ids += chunk_ids
        mask += [int(assistant(position + start, position + end)) for start, end in offsets]
    return ids, mask


def _chunks(text: str):
    """(position, chunk, whether mark_special_texts wrapped it) of `text`, the wrappers left out."""
    position = 0
    for found in LITERAL.finditer(text):
        yield position, text[position:found.start()], False
        yield found.start(1), found.group(1), True
        position = found.end()
    yield position, text[position:], False


def mark_special_texts(messages: list[dict], special_texts: tuple[str, ...]) -> list[dict]:
    """`messages` whose text contents hold each special token's text wrapped in LITERAL_OPEN/CLOSE (and
    none of those noncharacters of their own, which would pair with a wrapper)."""
    if not special_texts:
        return messages
    pattern = _special_text_pattern(special_texts)

    def marked(text: str) -> str:
        text = text.replace(LITERAL_OPEN, "").replace(LITERAL_CLOSE, "")
        return pattern.sub(lambda found: LITERAL_OPEN + found.group() + LITERAL_CLOSE, text)
    return [{**message, "content": marked(message["content"])} if isinstance(message.get("content"), str)
            else message for message in messages]


@lru_cache(maxsize=8)
def _special_text_pattern(special_texts: tuple[str, ...]) -> re.Pattern:
    """Any of the texts, the longest first (built once per tokenizer, not per conversation)."""
    return re.compile("|".join(re.escape(text) for text in sorted(special_texts, key=len, reverse=True)))


def encode_piece(text: str, tokenizer: Tokenizer) -> list[int]:
    """A rendered piece's ids: the template's text with its special tokens as their ids, the texts
    mark_special_texts wrapped (a message's) as ordinary text."""
    ids: list[int] = []
    for position, chunk, literal in _chunks(text):
        if chunk:
            ids += encode_continuing(tokenizer, chunk, literal) if position else \
                (tokenizer.encode_ordinary(chunk) if literal else tokenizer.encode(chunk))
    return ids
