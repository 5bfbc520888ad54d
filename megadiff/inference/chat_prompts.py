"""A chat-tuned checkpoint's prompts: conversations rendered by the chat template it was trained on
(data.chat_template, else its tokenizer's own), as `generate --chat`, `chat` and `lm-eval
--apply-chat-template` ask it, and encoded as training encodes them: the template's special tokens
become their ids, while a special token's text inside a message stays text (a user cannot end a
turn, or a document, by typing "<|im_end|>" or "<|endoftext|>")."""
from __future__ import annotations

from typing import Callable

from megadiff.config import ConfigError
from megadiff.data.conversations import (
    chat_template_of, encode_piece, mark_special_texts, render_conversation, turn_end,
)
from megadiff.checkpoint.single_process import CausalLM
from megadiff.data.tokenizers import Tokenizer, with_text_start


def checkpoint_chat_template(model: CausalLM, option: str) -> str:
    """The template the checkpoint's conversations were rendered with in training, which `option` asks for."""
    template = chat_template_of(model.cfg.data, model.tokenizer)
    if template is None:
        raise ConfigError(f"{option}: {model.checkpoint_dir} was trained without data.chat_template and its "
                          f"tokenizer {model.tokenizer.name!r} has no chat template")
    return template


def system_turns(system: str | None, chat: bool = True) -> list[dict]:
    """A conversation's opening: `--system`'s turn when one is given (only a chat has one)."""
    if system is None:
        return []
    if not chat:
        raise ConfigError("--system is a chat's system turn: add --chat")
    return [{"role": "system", "content": system}]


def render_chat(messages: list[dict], template: str, tokenizer: Tokenizer, generation_prompt: bool = True,
                continue_final: bool = False) -> str:
    """The prompt of `messages` (render_conversation's), every special token's text inside a message
    marked as training marks it, for encode_prompt to keep as text."""
    return render_conversation(mark_special_texts(messages, tokenizer.special_texts), template,
                               tokenizer.special_tokens, generation_prompt, continue_final)


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """The ids the model is given for `prompt`, a plain text or (`chat`) render_chat's: special tokens'
    texts become their ids, except the ones marked inside messages (plain text holds no marks). A plain
    text begins with the tokenizer's text_start (Llama's BOS) as documents do; a chat template writes
    its own start, as training's conversations and transformers' apply_chat_template read it."""
    ids = encode_piece(prompt, tokenizer)
    return ids if chat else with_text_start(tokenizer, ids)


def chat_renderer(model: CausalLM, option: str) -> tuple[Callable[[list[dict]], str], str | None]:
    """(messages -> the prompt: rendered up to the assistant's generation prompt, the text ending the
    reply), the template read once for every conversation it renders."""
    template = checkpoint_chat_template(model, option)
    tokenizer = model.tokenizer
    return (lambda messages: render_chat(messages, template, tokenizer),
            turn_end(template, tokenizer.special_tokens))


def chat_prompt(model: CausalLM, messages: list[dict], option: str) -> tuple[str, str | None]:
    """(the prompt, the text ending the reply) of one conversation."""
    render, reply_end = chat_renderer(model, option)
    return render(messages), reply_end
