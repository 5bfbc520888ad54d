"""`megadiff generate --prompts FILE --output OUT`: the completions of a file of prompts (samples to
compare runs by, long-context outputs for a judge, distillation data), decoded in batches,
data-parallel under torchrun, and resumable.

Each line of FILE is a JSON object: {"prompt": TEXT}, or with --chat {"messages": [...]} (a
conversation so far, ShareGPT turns too) or {"prompt": the user's message}; an "id" names it
(default: its line number). Every rank takes its share of the prompts not yet done, longest
first, and appends each batch's completions to OUT_rankN.jsonl as the batch ends; at the end rank 0
writes OUT, one line per prompt in FILE's order: {"id", "completion", "new_tokens", "finish"}
("stop": the EOD or, with --chat, the end of the assistant's turn; "length": --max-new-tokens).
A rerun, with any number of ranks, generates only the prompts the rank files do not hold. A sampled
prompt draws from a generator of --seed and its id: the same completion whatever the ranks and batches.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from megadiff.checkpoint.single_process import CausalLM, load_checkpoint
from megadiff.config import ConfigError
from megadiff.data.conversations import as_messages
from megadiff.data.errors import DataError
from megadiff.files import write_atomically
from megadiff.inference.chat_prompts import chat_renderer, encode_prompt, system_turns
from megadiff.inference.generate import check_generation, generate_batch, reply_text, stop_texts_check
from megadiff.inference.progress import ProgressTask, command_progress
from megadiff.inference.ranks import reports, share
from megadiff.inference.records import RankRecords, lines_of, model_settings, utf8_input
from megadiff.inference.reporting import command_console
from megadiff.models.transformer_config import PRECISION_DTYPES
from megadiff.parallel import wait_for_ranks

OUTPUT_FIELDS = ("id", "completion", "new_tokens", "finish")
# what completions kept before the request recorded top_p were sampled with
REQUEST_DEFAULTS = {"top_p": 1.0}


def read_prompts(path: str, chat: bool) -> list[tuple[str, object]]:
    """(id, the prompt's text or, with `chat`, its messages) of every line, checked before any model is read."""
    if not Path(path).is_file():
        raise ConfigError(f"--prompts {path} is not a file")
    prompts, ids = [], set()
    with utf8_input(f"--prompts {path}"):
        lines = lines_of(Path(path))
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--prompts {path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"--prompts {path}:{number}: not a JSON object: write each line as "
                              '{"id": ..., "prompt": "..."}')
        if chat and "messages" in record:
            try:
                prompt = as_messages(record["messages"])
            except DataError as err:
                raise ConfigError(f"--prompts {path}:{number}: {err}") from None
        elif isinstance(record.get("prompt"), str):
            prompt = [{"role": "user", "content": record["prompt"]}] if chat else record["prompt"]
        else:
            wanted = 'a "messages" list or a "prompt" string' if chat else 'a "prompt" string'
            raise ConfigError(f"--prompts {path}:{number}: {wanted} field is missing")
        key = str(record.get("id", number))
        if key in ids:
            raise ConfigError(f"--prompts {path}:{number}: id {key!r} comes twice")
        ids.add(key)
        prompts.append((key, prompt))
    if not prompts:
        raise ConfigError(f"--prompts {path} holds no prompts")
    return prompts


class Completions:
    """OUT_rankN.jsonl of every rank: what is done, and this rank's appends. Each record carries
    the request (checkpoint and decoding) and a digest of its prompt: a rerun asking otherwise, or
    of a prompt that changed under its id, is refused rather than handed old completions."""

    def __init__(self, output: str, request: dict, own_settings: dict):
        self.records = RankRecords(output, request, "--output", {**REQUEST_DEFAULTS, **own_settings})

    def done(self, digests: dict[str, str]) -> dict[str, dict]:
        """Every rank's completions so far of the prompts in `digests` (id -> digest)."""
        found = {}
        for file, record in self.records.read():
            if record["id"] not in digests:  # a prompt since taken out of the file
                continue
            if digests[record["id"]] != record["prompt_digest"]:
                raise ConfigError(f"{file}: prompt {record['id']!r} is not the one it was completed for: give "
                                  "another --output")
            found[record["id"]] = record
        return found

    def add(self, key: str, digest: str, completion: dict) -> None:
        self.records.add({"prompt_digest": digest, "id": key, **completion})


def _completion(model: CausalLM, new_ids: list[int], stop_text: str | None) -> dict:
    text = reply_text(model.tokenizer, new_ids)
    stopped = bool(new_ids) and new_ids[-1] in model.tokenizer.eos_ids
    if stop_text is not None and stop_text in text:
        text, stopped = text[:text.index(stop_text)], True
    return {"completion": text, "new_tokens": len(new_ids), "finish": "stop" if stopped else "length"}


def prompt_generator(seed: int, key: str) -> torch.Generator:
    """The generator a prompt's tokens are drawn with: of --seed and its id alone, so its sampled completion is
    the same on any number of ranks, in any batch, and in a run resumed after it was stopped."""
    digest = hashlib.sha256(json.dumps([seed, key]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def generate_file(model: CausalLM, prompts: list[tuple[str, object]], output: str, chat: bool = False,
                  system: str | None = None, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                  seed: int = 0, batch_size: int = 8, top_p: float = 1.0, dtype: str | None = None) -> int:
    """Generate what the rank files lack, then (rank 0) write `output`; returns how many were generated here.
    `dtype`: the --dtype asked for (None: the weights' own), as the rank files' requests record it."""
    tokenizer, window = model.tokenizer, model.cfg.model.seq_length
    if max_new_tokens >= window:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the window of {window}")
    render, stop_text = chat_renderer(model, "--chat") if chat else (None, None)
    opening = system_turns(system, chat)
    encoded = {}
    for key, prompt in prompts:
        if chat:
            prompt = render(opening + list(prompt))
        ids = encode_prompt(tokenizer, prompt, chat)[-(window - max_new_tokens):]  # a longer prompt keeps its end
        encoded[key] = ids or [tokenizer.eod]
    digests = {key: hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16] for key, ids in encoded.items()}
    settings, own_settings = model_settings(model, None, dtype)
    completions = Completions(output, {"checkpoint": str(Path(model.checkpoint_dir).resolve()),
                                       "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                                       "top_p": top_p, "seed": seed, **settings}, own_settings)
    done = completions.done(digests)
    todo = sorted((key for key, _ in prompts if key not in done), key=lambda key: -len(encoded[key]))
    mine = list(share(todo))
    console, started = command_console(), time.perf_counter()
    if done and reports():
        console.print(f"generate: {len(done)} of {len(prompts)} prompts done in {output}_rank*.jsonl, "
                      f"{len(todo)} to go")
    with command_progress("generate") as progress:
        task = ProgressTask(progress, f"{len(prompts)} prompts", len(mine))
        for start in range(0, len(mine), batch_size):
            batch = mine[start:start + batch_size]
            stops = None if stop_text is None else [stop_texts_check(tokenizer, [stop_text]) for _ in batch]
            answers = generate_batch(model, [encoded[key] for key in batch], max_new_tokens,
                                     stop_ids=tokenizer.eos_ids, stops=stops,
                                     temperature=temperature, top_k=top_k, top_p=top_p,
                                     generator=[prompt_generator(seed, key) for key in batch])
            for key, new_ids in zip(batch, answers):
                completions.add(key, digests[key], _completion(model, new_ids, stop_text))
                task.advance(1, len(encoded[key]) + len(new_ids))
    wait_for_ranks()  # every rank's last batch is in its file
    every = completions.done(digests)
    if reports():  # whole or not at all: cut short, its lines would look like every completion
        write_atomically(output, "".join(json.dumps({field: every[key][field] for field in OUTPUT_FIELDS}) + "\n"
                                         for key, _ in prompts).encode("utf-8"))
        new_tokens = sum(every[key]["new_tokens"] for key in todo)
        console.print(f"generate: wrote {len(prompts)} completions to {output} ({len(todo)} generated now, "
                      f"{new_tokens:,} new tokens in {time.perf_counter() - started:.1f} s)")
    return len(mine)


def generate_file_cli(load: str, prompts: str, output: str | None, chat: bool = False, system: str | None = None,
                      max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                      dtype: str | None = None, batch_size: int = 8, top_p: float = 1.0) -> int:
    """`megadiff generate --prompts FILE --output OUT`: everything is checked before the checkpoint is read."""
    if output is None:
        raise ConfigError("--prompts FILE needs --output OUT, where the completions go")
    check_generation(max_new_tokens, top_k, top_p, temperature)
    system_turns(system, chat)
    if batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if Path(output).exists() and Path(prompts).exists() and Path(output).samefile(prompts):
        raise ConfigError(f"--output {output} is the --prompts file: the completions would replace the prompts; "
                          "give them another file")
    requests = read_prompts(prompts, chat)
    model = load_checkpoint(load, PRECISION_DTYPES[dtype] if dtype else None)  # under torchrun: joins the ranks
    generate_file(model, requests, output, chat=chat, system=system, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size, dtype=dtype)
    return 0
