"""A chat-tuned checkpoint's prompts: conversations rendered by the chat template it was trained on
(data.chat_template, else its tokenizer's own), as `generate --chat`, `chat` and `lm-eval
--apply-chat-template` ask it."""
from __future__ import annotations

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


def chat_prompt(model: CausalLM, messages: list[dict], option: str) -> tuple[str, str | None]:
    """(the prompt, the text ending the reply): `messages` rendered up to the assistant's generation
    prompt."""
    template = checkpoint_chat_template(model, option)
    variables = model.tokenizer.special_tokens
    return render_conversation(messages, template, variables, generation_prompt=True), turn_end(template, variables)
