"""Text generation from a megadiff checkpoint: greedy, or sampling with temperature / top-k.

The prompt runs once; then each new token runs alone, the earlier positions' keys and values
(and DINT's running sum) kept in a KV cache. Past the model's window, the context slides as
in training: each step then runs the last `seq_length` tokens afresh (their positions moved).
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Iterator

import torch

from megadiff.data.tokenizers import Tokenizer
from megadiff.inference.loader import CausalLM, load_checkpoint
from megadiff.models.transformer_config import PRECISION_DTYPES

# what a byte-level tokenizer decodes a character's leading bytes to, until its last byte comes
INCOMPLETE_CHARACTER = "\ufffd"


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """logits [V] (fp32) -> one id: argmax at temperature 0, else a draw from softmax(logits / T) over the top k."""
    if temperature <= 0:
        return int(logits.argmax())
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def stream(model: CausalLM, prompt_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
           top_k: int = 0, seed: int = 0, vocab_in_use: int | None = None, stop_id: int | None = None,
           stop: Callable[[list[int]], bool] | None = None) -> Iterator[int]:
    """The new token ids after `prompt_ids`, each as soon as it is drawn; ids >= vocab_in_use
    (embedding padding) are never produced. Generation ends after `stop_id`, or once
    `stop(new ids)` is true (e.g. a stop string was decoded)."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    generator = torch.Generator().manual_seed(seed)
    window = model.cfg.model.seq_length
    ids = list(prompt_ids)
    cache = model.new_cache(max_length=min(window, len(ids) + max_new_tokens))
    pending = ids[-window:]  # what the cache has not seen yet
    for _ in range(max_new_tokens):
        if cache.length + len(pending) > cache.max_length:
            cache.reset()
            pending = ids[-window:]
        with torch.no_grad():
            logits = model.next_token_logits(torch.tensor([pending]), cache)[0].float().cpu()
        if vocab_in_use is not None:
            logits[vocab_in_use:] = float("-inf")
        token = next_token(logits, temperature, top_k, generator)
        ids.append(token)
        pending = [token]
        yield token
        if token == stop_id or (stop is not None and stop(ids[len(prompt_ids):])):
            return


def generate(model: CausalLM, prompt_ids: list[int], **options) -> list[int]:
    """All of stream()'s new token ids (the same options)."""
    return list(stream(model, prompt_ids, **options))


class TextStream:
    """The text of a growing list of new token ids, handed out in the pieces not yet shown."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def add(self, token: int) -> str:
        """The text `token` adds: empty while it ends in a character whose bytes span tokens."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith(INCOMPLETE_CHARACTER):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def rest(self) -> str:
        """What is left unshown (an incomplete last character, as the tokenizer decodes it)."""
        return self.tokenizer.decode(self.ids)[len(self.shown):]


def generate_cli(load: str, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0, dtype: str | None = None) -> int:
    """`megadiff generate`: print the prompt, then its continuation as it is generated (the rate on
    stderr); the weights in `dtype` (default: the checkpoint's training precision)."""
    model = load_checkpoint(load, PRECISION_DTYPES[dtype] if dtype else None)
    tokenizer = model.tokenizer
    prompt_ids = tokenizer.encode(prompt)
    print(prompt, end="", flush=True)
    text, started = TextStream(tokenizer), time.perf_counter()
    for token in stream(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        seed=seed, vocab_in_use=tokenizer.vocab_size, stop_id=tokenizer.eod):
        if token != tokenizer.eod:
            print(text.add(token), end="", flush=True)
    print(text.rest(), flush=True)
    elapsed = time.perf_counter() - started
    print(f"generate: {len(text.ids)} tokens after a {len(prompt_ids)}-token prompt in {elapsed:.1f} s "
          f"({len(text.ids) / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0
