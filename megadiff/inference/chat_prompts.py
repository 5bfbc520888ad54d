"""A chat-tuned checkpoint's prompts: conversations rendered by the chat template it was trained on
(data.chat_template, else its tokenizer's own), as `generate --chat`, `chat` and `lm-eval
--apply-chat-template` ask it."""
from __future__ import annotations

from typing import Callable

from megadiff.config import ConfigError
from megadiff.data.conversations import chat_template_of, render_conversation, turn_end
from megadiff.inference.loader import CausalLM


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


def chat_renderer(model: CausalLM, option: str) -> tuple[Callable[[list[dict]], str], str | None]:
    """(messages -> the prompt: rendered up to the assistant's generation prompt, the text ending the
    reply), the template read once for every conversation it renders."""
    template = checkpoint_chat_template(model, option)
    variables = model.tokenizer.special_tokens
    return (lambda messages: render_conversation(messages, template, variables, generation_prompt=True),
            turn_end(template, variables))


def chat_prompt(model: CausalLM, messages: list[dict], option: str) -> tuple[str, str | None]:
    """(the prompt, the text ending the reply) of one conversation."""
    render, reply_end = chat_renderer(model, option)
    return render(messages), reply_end
