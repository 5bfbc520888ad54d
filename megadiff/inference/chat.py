"""`megadiff chat`: talk to a chat-tuned checkpoint, a message per line of standard input.

Each message joins the conversation (after `--system`'s turn), the whole conversation is rendered
by the checkpoint's chat template up to the assistant's turn, and the reply is printed as it is
generated, up to the end of its turn; it then joins the conversation too. End of input ends it.
One KV cache serves the whole conversation: each turn runs only what the cache does not already
hold (the new message, and whatever of the last reply the template renders otherwise).
"""
from __future__ import annotations

import sys

from megadiff.checkpoint.single_process import load_checkpoint
from megadiff.inference.chat_prompts import chat_renderer, system_turns
from megadiff.inference.generate import HeldContext, check_generation, print_continuation
from megadiff.inference.records import utf8_input
from megadiff.models.transformer_config import PRECISION_DTYPES


def chat_cli(load: str, system: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, dtype: str | None = None, top_p: float = 1.0) -> int:
    check_generation(max_new_tokens, top_k, top_p, temperature)
    model = load_checkpoint(load, PRECISION_DTYPES[dtype] if dtype else None)
    render, reply_end = chat_renderer(model, "chat")  # no template: refused before any input
    messages = system_turns(system)
    interactive, context = sys.stdin.isatty(), HeldContext(model)
    for turn, line in enumerate(_messages(interactive)):
        messages.append({"role": "user", "content": line})
        reply = print_continuation(model, render(messages), reply_end, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + turn,
                                   context=context, chat=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _messages(interactive: bool):
    """The non-empty lines of standard input, prompted for on a terminal."""
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        with utf8_input("standard input"):
            line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")
