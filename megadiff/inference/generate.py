"""Text generation from a megadiff checkpoint: greedy, or sampling with temperature / top-k / top-p.

The prompt runs once; then each new token runs alone, the earlier positions' keys and values
(and DINT's running sum) kept in a KV cache. Past the model's window, the context slides as
in training: each step then runs the last `seq_length` tokens afresh (their positions moved).
Prompts decode side by side (`generate_batch`), their rows kept of one length: no padding, so
no masks. Prompts that grow from each other (a conversation's turns) can share one cache
(`HeldContext`): each runs from the longest prefix the cache still holds.
A checkpoint trained with data.document_masking attends within documents here too: a prompt runs
from after its last EOD, and a row whose document begins after what the cache holds (a prompt
ended by an EOD, once its first new token is drawn) runs whole, with document masking, each step.
Only ids the tokenizer can decode are drawn (not the embedding's padding, nor a tokenizer's holes).
"""
from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator, Sequence

import torch

from megadiff.checkpoint.single_process import CausalLM, load_checkpoint
from megadiff.config import ConfigError
from megadiff.data.tokenizers import Tokenizer
from megadiff.inference.chat_prompts import chat_prompt, encode_prompt, system_turns
from megadiff.inference.records import utf8_input
from megadiff.models.transformer_config import PRECISION_DTYPES

# what a byte-level tokenizer decodes a character's leading bytes to, until its last byte comes
INCOMPLETE_CHARACTER = "\ufffd"
# sampling's randomness: one generator for every row, a list of one per row, or torch's default
Generators = torch.Generator | list[torch.Generator] | None


def check_generation(max_new_tokens: int, top_k: int = 0, top_p: float = 1.0, temperature: float = 0.0) -> None:
    """Refuse a budget or sampling that generation cannot honour (before any checkpoint is read)."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens (--max-new-tokens) must be >= 1, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # NaN too: a negative one read as greedy, NaN and inf failed in torch
        raise ConfigError(f"temperature (--temperature) must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ConfigError(f"top_k (--top-k) must be >= 0 (0: every id), got {top_k}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p (--top-p) must be within (0, 1] (1: every id), got {top_p}")


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [rows, V] with every id outside the row's nucleus at -inf: the likeliest ids whose
    probabilities, taken in order, first reach `top_p` (the likeliest id always)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    likelier_mass = probs.cumsum(dim=-1) - probs
    return logits.scatter(-1, order, ordered.masked_fill(likelier_mass >= top_p, float("-inf")))


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, generator: Generators,
                top_p: float = 1.0) -> list[int]:
    """logits [rows, V] (fp32) -> an id per row: argmax at temperature 0, else a draw from
    softmax(logits / T) over the row's top k, then over its nucleus of mass top_p, with `generator` (one for
    all rows, or a list of one per row)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        logits = nucleus(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    if isinstance(generator, list):
        return [int(torch.multinomial(row, 1, generator=own)) for row, own in zip(probs, generator)]
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator,
               top_p: float = 1.0) -> int:
    """next_tokens() of one row of logits [V]."""
    return next_tokens(logits[None], temperature, top_k, generator, top_p)[0]


def decodable_ids(model: CausalLM) -> torch.Tensor:
    """[V] booleans over the model's padded vocabulary: the ids its tokenizer can decode."""
    tokenizer = model.tokenizer
    decodable = torch.zeros(model.vocab_size, dtype=torch.bool)
    decodable[:tokenizer.vocab_size] = True
    decodable[sorted(tokenizer.undecodable_ids)] = False
    return decodable


def document_eod(model: CausalLM) -> int | None:
    """The EOD a data.document_masking checkpoint never attended across (None: it attends to every token)."""
    return model.tokenizer.eod if model.cfg.data.document_masking else None


def attended_part(ids: list[int], eod: int | None) -> list[int]:
    """What of `ids` their last token attends to: all of them, or with document masking (`eod`) the
    document it ends, from after the last EOD before it (RoPE is relative: no position need move)."""
    if eod is None:
        return ids
    return ids[next((i + 1 for i in range(len(ids) - 2, -1, -1) if ids[i] == eod), 0):]


class HeldContext:
    """A KV cache kept from one generation to the next, whose prompts grow from each other (a
    conversation's turns): each prompt runs from the longest prefix of it the cache still holds."""

    def __init__(self, model: CausalLM):
        self.cache = model.new_cache(rewindable=True)
        self.ids: list[int] = []  # the tokens whose keys the cache holds, from its first position
        self.reused = 0

    def reuse(self, prompt: list[int]) -> int:
        """Truncate the cache to the longest prefix it shares with `prompt` (short of prompt's last
        token, whose logits are wanted); returns (and keeps in `reused`) how many tokens it holds."""
        shared, limit = 0, min(len(self.ids), len(prompt) - 1)
        while shared < limit and self.ids[shared] == prompt[shared]:
            shared += 1
        self.reused = self.cache.truncate(shared)
        self.cache.forget_call_ends_before(self.reused)  # a conversation goes back at most into its last reply
        del self.ids[self.reused:]
        return self.reused

    def forget(self) -> None:
        """The cache no longer holds the sequence from its start (the context slid, or runs whole)."""
        self.ids.clear()
        self.reused = 0


class Decoder:
    """Next-token logits of rows of one length as each grows by a token: the prompts run once,
    then each new token (KV cache); past the model's window the context slides as in training.
    With a `context` (one row), the prompt runs from what its cache holds, and it keeps what runs.
    `decodable` [V]: the ids that may be drawn (default: those the tokenizer decodes, decodable_ids()).
    With document masking, once a row's document begins after the cache's first position, the rows run
    whole each step (see the module)."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
                 decodable: torch.Tensor | None = None, context: HeldContext | None = None):
        if not all(prompts) or len({len(prompt) for prompt in prompts}) != 1:
            raise ValueError("a decoder's prompts must be non-empty and of one length")
        if context is not None and len(prompts) != 1:
            raise ValueError("a held context continues one sequence")
        self.model, self.context = model, context
        # the ids never drawn, found once: masking the vocabulary anew for every token cost 100x more
        self.blocked = (~(decodable_ids(model) if decodable is None else decodable)).nonzero()[:, 0]
        self.window = model.cfg.model.seq_length
        self.rows = [list(prompt) for prompt in prompts]
        self.eod = document_eod(model)
        self.last_eods = [max((i for i, token in enumerate(row) if token == self.eod), default=-1) for row in self.rows]
        self.whole = False
        if context is None:
            self.cache, held = model.new_cache(len(prompts), min(self.window, len(prompts[0]) + max_new_tokens)), 0
        else:
            self.cache, held = context.cache, context.reuse(self.rows[0])
        self.pending = [row[held:] for row in self.rows]  # what the cache has not seen yet

    @torch.no_grad()
    def logits(self, wanted: Iterable[int] | None = None) -> torch.Tensor:
        """[rows, V] fp32 on the host: each row's next-token logits (undecodable ids at -inf).
        `wanted`: the rows whose logits are used (default: all; a finished row's may cross documents)."""
        self.whole = self.whole or self._crosses_documents(range(len(self.rows)) if wanted is None else wanted)
        logits = self._whole_logits() if self.whole else self._cached_logits()
        logits.index_fill_(1, self.blocked, float("-inf"))
        return logits

    def _crosses_documents(self, wanted: Iterable[int]) -> bool:
        """Whether the cache would show a wanted row's last token an earlier document."""
        if self.eod is None:
            return False
        attended = min(self.cache.length + len(self.pending[0]), self.window)
        return any(len(self.rows[row]) - attended <= self.last_eods[row] < len(self.rows[row]) - 1 for row in wanted)

    def _cached_logits(self) -> torch.Tensor:
        if self.cache.length + len(self.pending[0]) > self.cache.max_length:
            self.cache.reset()
            self.pending = [row[-self.window:] for row in self.rows]
            if self.context is not None:
                self.context.forget()
        logits = self.model.next_token_logits(torch.tensor(self.pending), self.cache).float().cpu()
        if self.context is not None:
            self.context.ids.extend(self.pending[0])
        return logits

    def _whole_logits(self) -> torch.Tensor:
        """The rows' last `window` tokens run afresh, attention kept within their documents."""
        if self.context is not None:
            self.context.forget()
        ids = torch.tensor([row[-self.window:] for row in self.rows])
        return self.model.output_logits(self.model.hidden_states(ids, self.eod)[-1:])[0].float().cpu()

    def append(self, tokens: list[int]) -> None:
        for index, (row, token) in enumerate(zip(self.rows, tokens)):
            row.append(token)
            if token == self.eod:
                self.last_eods[index] = len(row) - 1
        self.pending = [[token] for token in tokens]


def reply_text(tokenizer: Tokenizer, new_ids: list[int]) -> str:
    """The text of generated ids, without the EOS that ended them (generation stops at the first)."""
    return tokenizer.decode([token for token in new_ids if token not in tokenizer.eos_ids])


def stop_texts_check(tokenizer: Tokenizer, stop_texts: Sequence[str]) -> Callable[[list[int]], bool]:
    """A generate_batch() stop: whether the new ids' text holds one of `stop_texts`. Checked after every
    token, so one can only have been completed by the last: decoding the last tokens that can hold it
    (a character takes at most 4 bytes, a token at least one, and one more for a character cut at the
    start) finds it as decoding them all would, without decoding a 16K-token answer 16K times."""
    window = 4 * max((len(text) for text in stop_texts), default=0) + 2

    def stopped(new_ids: list[int]) -> bool:
        text = tokenizer.decode(new_ids[-window:])
        return any(stop in text for stop in stop_texts)
    return stopped


def stream(model: CausalLM, prompt_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
           top_k: int = 0, seed: int = 0, decodable: torch.Tensor | None = None, stop_ids: Collection[int] = (),
           stop: Callable[[list[int]], bool] | None = None, context: HeldContext | None = None,
           top_p: float = 1.0) -> Iterator[int]:
    """The new token ids after `prompt_ids`, each as soon as it is drawn; only ids `decodable`
    ([V] booleans; default: decodable_ids()) are produced. Generation ends after one of `stop_ids`, or once
    `stop(new ids)` is true (e.g. a stop string was decoded). `context`: the cache to continue."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    generator = torch.Generator().manual_seed(seed)
    decoder = Decoder(model, [attended_part(prompt_ids, document_eod(model))], max_new_tokens, decodable, context)
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = next_token(decoder.logits()[0], temperature, top_k, generator, top_p)
        decoder.append([token])
        new.append(token)
        yield token
        if token in stop_ids or (stop is not None and stop(new)):
            return


def generate(model: CausalLM, prompt_ids: list[int], **options) -> list[int]:
    """All of stream()'s new token ids (the same options)."""
    return list(stream(model, prompt_ids, **options))


def generate_batch(model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
                   decodable: torch.Tensor | None = None, stop_ids: Collection[int] = (),
                   stops: list[Callable[[list[int]], bool]] | None = None, temperature: float = 0.0, top_k: int = 0,
                   generator: Generators = None, top_p: float = 1.0) -> list[list[int]]:
    """The new ids after each of `prompts`, decoded side by side: greedy (generate()'s answers), or
    drawn at `temperature` from each row's top k and nucleus top_p with `generator`: one for every
    prompt, or a list of one per prompt, which then draws each prompt's tokens only (its answer the
    same whatever batch it decodes in). Each row ends where generate() ends it (after one of stop_ids, or once
    its `stops[row](new ids)` is true).

    Rows stay of one length, so no padding and no masks: the prompts run together up to the
    shortest one's length, then each step feeds every row its next token, a longer prompt's own
    until it is used up (its logits meanwhile unused), then the drawn one. Each token a longer
    prompt has beyond the shortest costs a step, so prompts whose lengths differ by more than
    max_new_tokens decode apart, one group after another (length_groups): a 64K prompt beside a
    1K one would take 63K steps of one token each, where apart it runs in one pass."""
    if max_new_tokens < 1:
        raise ValueError(f"generate_batch needs max_new_tokens >= 1, got {max_new_tokens}")
    eod = document_eod(model)
    prompts = [attended_part(prompt, eod) for prompt in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    for group in length_groups([len(prompt) for prompt in prompts], max_new_tokens):
        for row, answer in zip(group, _decode_side_by_side(
                model, [prompts[row] for row in group], max_new_tokens, decodable, stop_ids,
                None if stops is None else [stops[row] for row in group], temperature, top_k,
                _of_rows(generator, group), top_p)):
            answers[row] = answer
    return answers


def _of_rows(generator: Generators, rows: list[int]) -> Generators:
    """The generators of `rows`: theirs from a list of one per row, else the one for all."""
    return [generator[row] for row in rows] if isinstance(generator, list) else generator


def length_groups(lengths: list[int], span: int) -> list[list[int]]:
    """The indices of `lengths`, in groups of lengths within `span` of their group's longest (longest
    groups first, indices ascending within each)."""
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[groups[-1][0]] - lengths[index] <= span:
            groups[-1].append(index)
        else:
            groups.append([index])
    return [sorted(group) for group in groups]


def _decode_side_by_side(model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
                         decodable: torch.Tensor | None, stop_ids: Collection[int],
                         stops: list[Callable[[list[int]], bool]] | None, temperature: float, top_k: int,
                         generator: Generators, top_p: float) -> list[list[int]]:
    """generate_batch() of prompts (attended parts) decoded in one batch. Only the rows past their prompt
    and not yet ended draw a token: a prompt's own generator draws for it alone."""
    shortest = min(len(prompt) for prompt in prompts)
    decoder = Decoder(model, [prompt[:shortest] for prompt in prompts],
                      max(len(prompt) for prompt in prompts) - shortest + max_new_tokens, decodable)
    answers: list[list[int]] = [[] for _ in prompts]
    running = set(range(len(prompts)))
    while running:
        logits = decoder.logits(running)
        drawing = [row for row in sorted(running) if len(decoder.rows[row]) >= len(prompts[row])]
        own = _of_rows(generator, drawing)
        drawn = dict(zip(drawing, next_tokens(logits[drawing], temperature, top_k, own, top_p) if drawing else []))
        # a row within its prompt takes the prompt's next token; an ended one repeats its last (never read)
        step = [prompt[len(row)] if len(row) < len(prompt) else drawn.get(index, row[-1])
                for index, (prompt, row) in enumerate(zip(prompts, decoder.rows))]
        for row, token in drawn.items():
            answers[row].append(token)
            if (token in stop_ids or len(answers[row]) == max_new_tokens
                    or (stops is not None and stops[row](answers[row]))):
                running.discard(row)
        decoder.append(step)
    return answers


class TextStream:
    """The text of a growing list of new token ids, handed out in the pieces not yet shown; with
    `stop_text`, the text before it only (`stopped` once it is decoded), held back while it may be
    the start of it. Each token decodes the few after the last completed character, with the ones
    before it for context (a tokenizer may write a token by what precedes it, e.g. a word's space),
    not the whole reply: that was quadratic in its length. A tokenizer whose decode cleans up spaces
    (`space_cleanup`, " ' s" -> "'s") is decoded without it, and the cleanup applied to the text
    no later token can change (_settled)."""

    def __init__(self, tokenizer: Tokenizer, stop_text: str | None = None):
        self.tokenizer, self.stop_text, self.ids, self.shown = tokenizer, stop_text, [], ""
        self.cleanup = getattr(tokenizer, "space_cleanup", None)
        self._decode = tokenizer.decode_uncleaned if self.cleanup else tokenizer.decode
        self.text = ""  # of the ids up to `_read` (once stopped: up to the stop text), uncleaned
        self.stopped = False
        self._context = self._read = 0  # ids[_context:_read]: the text before the undecided ids
        self._cleaned, self._cleaned_to = "", 0  # the cleanup of text[:_cleaned_to], which no token can change

    def add(self, token: int) -> str:
        """The text `token` adds: empty while it ends in a character whose bytes span tokens."""
        self.ids.append(token)
        if not self.stopped:
            self._read_new()
        visible = self._settled()
        end = len(visible)
        if self.stop_text is not None and not self.stopped:
            end = max(len(self.shown), end - len(self.stop_text) + 1)
        piece, self.shown = visible[len(self.shown):end], visible[:end]
        return piece

    def rest(self) -> str:
        """What is left unshown (an incomplete last character, as the tokenizer decodes it)."""
        text = self.text + ("" if self.stopped else self._undecided())
        return (self.cleanup(text) if self.cleanup else text)[len(self.shown):]

    def _settled(self) -> str:
        """The text as decode gives it, up to where a later token may still change it (_SETTLED)."""
        if self.cleanup is None:
            return self.text
        ends = [end.end() for end in _SETTLED.finditer(self.text, self._cleaned_to)]
        if ends and ends[-1] > self._cleaned_to:
            self._cleaned += self.cleanup(self.text[self._cleaned_to:ends[-1]])
            self._cleaned_to = ends[-1]
        return self._cleaned

    def _undecided(self) -> str:
        known = self._decode(self.ids[self._context:self._read])
        return self._decode(self.ids[self._context:])[len(known):]

    def _read_new(self) -> None:
        new = self._undecided()
        if self.stop_text is not None:  # a stop text ends before any incomplete character
            at = (self.text + new).find(self.stop_text, max(0, len(self.text) - len(self.stop_text) + 1))
            if at >= 0:
                self.text, self.stopped = (self.text + new)[:at], True
                return
        if new and not new.endswith(INCOMPLETE_CHARACTER):
            self.text += new
            self._context, self._read = self._read, len(self.ids)


# transformers' clean_up_tokenization deletes the space of " .", " ?", " !", " ,", " ' " (the one after "'" too),
# " n't", " 'm", " 's", " 've" and " 're", and no other character: a match reaching past a point holds the
# character before it, and at most 3 after its space. So whatever follows, the text is cleaned for good up to
# a character other than a space that no pattern holds, or up to 4 characters none of them a space.
_SETTLED = re.compile(r"(?:(?<=[^ ]{4})|(?<=[^ .?!,'nmstver]))")


def print_continuation(model: CausalLM, prompt: str, stop_text: str | None = None, max_new_tokens: int = 32,
                       temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                       context: HeldContext | None = None, top_p: float = 1.0, chat: bool = False) -> str:
    """Print `prompt`'s continuation as it is generated, up to an EOS (or `stop_text`, unshown), and
    its rate on stderr; returns the text printed. `context`: the cache to continue (a conversation's);
    `chat`: the prompt is a rendered conversation (encode_prompt)."""
    tokenizer = model.tokenizer
    prompt_ids = encode_prompt(tokenizer, prompt, chat)
    text, started = TextStream(tokenizer, stop_text), time.perf_counter()
    for token in stream(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop_ids=tokenizer.eos_ids,
                        stop=lambda _: text.stopped, context=context):
        if token not in tokenizer.eos_ids:
            print(text.add(token), end="", flush=True)
    rest = text.rest()
    print(rest, flush=True)
    elapsed = time.perf_counter() - started
    cached = f" ({context.reused} of them cached)" if context is not None else ""
    print(f"generate: {len(text.ids)} tokens after a {len(prompt_ids)}-token prompt{cached} in {elapsed:.1f} s "
          f"({len(text.ids) / elapsed:.1f} tokens/s)", file=sys.stderr)
    return text.shown + rest


def generate_cli(load: str, prompt: str | None, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0, dtype: str | None = None, prompt_file: str | None = None, chat: bool = False,
                 system: str | None = None, output: str | None = None, top_p: float = 1.0,
                 batch_size: int | None = None) -> int:
    """`megadiff generate`: print the prompt (or `prompt_file`'s text; '-': standard input), then
    its continuation as it is generated (the rate on stderr); the weights in `dtype` (default: the
    checkpoint's training precision). With `chat`, the prompt is the user's message to a chat-tuned
    checkpoint (after `system`'s turn) and the assistant's reply alone is printed, up to the end of
    its turn. (`--prompts FILE`: inference/generate_file.py.)"""
    check_generation(max_new_tokens, top_k, top_p, temperature)
    opening = system_turns(system, chat)
    if output is not None:
        raise ConfigError("--output is where the completions of --prompts FILE go")
    if batch_size is not None:  # a single prompt has nothing to batch: the option would be silently ignored
        raise ConfigError("--batch-size is how many prompts of --prompts FILE decode side by side")
    if prompt is None:
        if prompt_file != "-" and not Path(prompt_file).is_file():
            raise ConfigError(f"--prompt-file {prompt_file} is not a file")
        with utf8_input("standard input" if prompt_file == "-" else f"--prompt-file {prompt_file}"):
            prompt = sys.stdin.read() if prompt_file == "-" else Path(prompt_file).read_text(encoding="utf-8")
    if not prompt and not chat:
        raise ConfigError("the prompt is empty: give some text to continue")
    model = load_checkpoint(load, PRECISION_DTYPES[dtype] if dtype else None)
    reply_end = None
    if chat:
        prompt, reply_end = chat_prompt(model, opening + [{"role": "user", "content": prompt}], "--chat")
    else:
        print(prompt, end="", flush=True)
    print_continuation(model, prompt, reply_end, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, chat=chat)
    return 0
