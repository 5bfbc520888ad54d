"""`megadiff lm-eval`: EleutherAI's lm-evaluation-harness on a megadiff checkpoint, unconverted.

The papers report zero- and few-shot accuracy through the harness (ARC, BoolQ, HellaSwag, OBQA,
PIQA, WinoGrande). `MegadiffLM` answers the harness's three kinds of request with the checkpoint's
own model and tokenizer: log-likelihoods of continuations (multiple choice), rolling
log-likelihoods of whole texts (perplexity tasks) and greedy or sampled generation up to stop strings.
Under torchrun every rank loads the model and the harness gives each rank its share of the
requests; rank 0 prints and writes the results.

`--attention-logit-bits B` quantizes every attention map's logits to B bits first (dynamic absmax,
each query's row; the DIFF paper's Figure 8: HellaSwag accuracy from 16 down to 4 bits, DIFF
against the softmax Transformer), through the reference attention that materialises the maps.

`--apply-chat-template` renders every request as a conversation (the harness's user turns, few-shot
examples as turns with `--fewshot-as-multiturn`, `--system-instruction`) with the template the
checkpoint's conversations were trained on (data.chat_template, else its tokenizer's own), and
encoded as training encodes them (inference/chat_prompts.py): a fine-tuned chat model is asked as
it was taught.

Generation runs the context once, then each new token alone (KV cache: inference/generate.py).
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import urllib.error
import urllib.request
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megadiff.checkpoint.format import checkpoint_config, resolve_checkpoint_dir
from megadiff.config import ConfigError
from megadiff.console import plain_console
from megadiff.errors import MegadiffError, refused_together
from megadiff.files import write_atomically
from megadiff.inference.chat_prompts import checkpoint_chat_template, encode_prompt, render_chat
from megadiff.inference.generate import (
    check_generation, document_eod, generate_batch, reply_text, stop_texts_check,
)
from megadiff.inference.generate_file import prompt_generator
from megadiff.checkpoint.single_process import LOSS_CHUNK_TOKENS, CausalLM, load_checkpoint
from megadiff.inference.progress import ProgressTask, command_progress
from megadiff.inference.ranks import gather_across_ranks, reports
from megadiff.inference.reporting import command_console
from megadiff.models.transformer_config import PRECISION_DTYPES
from megadiff.parallel import init_process_group, rank_and_world, wait_for_ranks

try:
    from lm_eval import simple_evaluate
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.task import Task
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.tasks import TaskManager, get_task_dict
    from lm_eval.utils import (
        get_rolling_token_windows, handle_non_serializable, make_disjoint_window, make_table, simple_parse_args_string,
    )
except ImportError:  # the command says how to install it; importing megadiff never needs it
    TemplateLM = object
    HARNESS_MISSING = True
else:
    HARNESS_MISSING = False

# (context ids, continuation ids): the continuation's tokens are the ones scored
TokenPair = tuple[list[int], list[int]]
# the generation kwargs generation here follows (until and max_gen_toks aside), and others other
# backends take, at the value that changes nothing: any other is refused rather than ignored
HONOURED_GEN_KWARGS = ("do_sample", "temperature", "top_k", "top_p")
NEUTRAL_GEN_KWARGS = {"num_beams": 1, "repetition_penalty": 1.0}
VLLM_NO_TOP_K = -1  # what vLLM's top_k takes for every id (a task written for vLLM may say so)
# what a --cache's answers depend on beside the requests' text (the harness keys them on that alone),
# each with the option that sets it
CACHE_REQUEST_OPTIONS = {"checkpoint": "--load", "dtype": "--dtype", "attention_logit_bits": "--attention-logit-bits",
                         "chat_template": "--apply-chat-template", "system_instruction": "--system-instruction",
                         "fewshot_as_multiturn": "--fewshot-as-multiturn", "gen_kwargs": "--gen-kwargs",
                         # contexts begin with it (a cache answered before they did records none)
                         "text_start": "the tokenizer's text start"}


def generation_settings(gen_kwargs: dict, default_max_gen_toks: int, window: int) -> dict:
    """lm_eval's normalised generation kwargs, refused where generation here cannot honour them; a
    kwarg given as None (YAML's null) is its default, and top_k and top_p are set (0 and 1: every id)."""
    kwargs = normalize_gen_kwargs({key: value for key, value in gen_kwargs.items() if value is not None},
                                  default_max_gen_toks)
    ignored = sorted(key for key, value in kwargs.items() if key not in HONOURED_GEN_KWARGS + ("until", "max_gen_toks")
                     and (key not in NEUTRAL_GEN_KWARGS or NEUTRAL_GEN_KWARGS[key] != value))
    if ignored:
        raise ConfigError(f"lm-eval: generation here does not do {ignored} (it follows {list(HONOURED_GEN_KWARGS)}, "
                          "until and max_gen_toks)")
    if kwargs["max_gen_toks"] >= window:
        raise ConfigError(f"the task generates up to {kwargs['max_gen_toks']} tokens; the model's window is {window}")
    top_k = int(kwargs.get("top_k", 0))
    kwargs.update(top_k=0 if top_k == VLLM_NO_TOP_K else top_k, top_p=float(kwargs.get("top_p", 1.0)))
    check_generation(kwargs["max_gen_toks"], kwargs["top_k"], kwargs["top_p"])
    return kwargs


@dataclass(frozen=True)
class GenerationPlan:
    """One generation request, encoded: its prompt ids (cut to leave room for max_new)."""
    prompt: list[int]
    max_new: int
    until: list[str]
    temperature: float
    top_k: int
    top_p: float

    @property
    def decoding(self) -> tuple:
        """Plans alike in these decode side by side."""
        sampled = self.temperature > 0
        return self.max_new, max(self.temperature, 0.0), self.top_k if sampled else 0, self.top_p if sampled else 1.0


class MegadiffLM(TemplateLM):
    """The harness's language-model interface over a loaded checkpoint."""

    def __init__(self, model: CausalLM, batch_size: int = 8, max_gen_toks: int = 256,
                 chat_template: str | None = None, seed: int = 1234):
        super().__init__()
        self.model = model
        self.tok = model.tokenizer
        self._chat_template = chat_template
        self.batch_size = batch_size
        self.max_length = model.cfg.model.seq_length
        self.max_gen_toks = max_gen_toks
        # a checkpoint trained with data.document_masking never attended across an end-of-document
        # token: nor does an end-of-document prefix_token_id (empty contexts, rolling windows) here
        self.document_eod = document_eod(model)
        self._rank, self._world_size = rank_and_world()
        self._device = model.device
        self.seed = seed  # sampled generations draw from generators of it (request_generators)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.name)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on: the tokenizer's text start
        (Llama's BOS, as the harness's Hugging Face model takes it), else the end-of-document token, which
        began every document in training (the harness's model takes a BOS the tokenizer names but does
        not add, e.g. SmolLM2's <|im_start|>)."""
        return self.tok.text_start[0] if self.tok.text_start else self.tok.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """A context begins as a text does (encode_prompt), unless the harness asks for the bare tokens (a
        continuation after prefix_token_id) or the string is a rendered conversation."""
        return encode_prompt(self.tok, string, chat=self._chat_template is not None or add_special_tokens is False)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template requests are rendered with (the harness records it with the results)."""
        return self._chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The harness's turns as the template writes them; without the generation prompt the last
        (assistant) turn stays open, as the harness's Hugging Face model leaves it."""
        return render_chat(chat_history, self._chat_template, self.tok, generation_prompt=add_generation_prompt,
                           continue_final=not add_generation_prompt)

    @contextmanager
    def progress(self, description: str, requests: int) -> Iterator[ProgressTask]:
        """A bar over this rank's requests of one kind (rank 0 shows it)."""
        progress = command_progress("lm-eval")
        with progress:
            yield ProgressTask(progress, description, requests)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        def cached(index: int, answer: tuple[float, bool]) -> None:
            if requests[index][0] is not None:  # the request's (context, continuation) strings
                self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)

        with self.progress("log-likelihoods", len(requests)) as bar:
            return self.score([self._conditioned(context, continuation) for _, context, continuation in requests],
                              bar, cached)

    def _conditioned(self, context: list[int], continuation: list[int]) -> TokenPair:
        """The pair, a context of no tokens conditioned on prefix_token_id as the harness conditions an empty
        one: a whitespace context (the harness moves its spaces onto the continuation) encodes to none where
        texts begin with no BOS, and nothing would predict the continuation's first token."""
        if context:
            return context, continuation
        if continuation[:1] == [self.prefix_token_id]:
            return continuation[:1], continuation[1:]
        return [self.prefix_token_id], continuation

    @torch.no_grad()
    def score(self, pairs: Sequence[TokenPair], bar: ProgressTask | None = None,
              answered: Callable[[int, tuple[float, bool]], None] | None = None) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether greedy decoding gives it) of each pair; the
        context is cut from the left to fit the model's window, as the harness's HF model does.
        `answered(index, answer)` hears of each answer as soon as its batch is done."""
        too_long = max((len(continuation) for _, continuation in pairs), default=0)
        if too_long > self.max_length:
            raise ConfigError(f"a continuation of {too_long} tokens does not fit the model's window of "
                              f"{self.max_length}")
        windows = [(context + continuation)[-(self.max_length + 1):][:-1] for context, continuation in pairs]
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        # longest first, so a batch pads little and the first batch shows the memory needed
        order = sorted(range(len(pairs)), key=lambda i: -len(windows[i]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = len(windows[batch[0]])
            # right padding: causal attention keeps the padding out of every scored position
            ids = torch.full((len(batch), width), self.tok.eod, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(windows[i])] = torch.tensor(windows[i])
            hidden = self.model.hidden_states(ids, self.document_eod)
            for row, i in enumerate(batch):
                results[i] = self._continuation_score(hidden[:len(windows[i]), row:row + 1], pairs[i][1])
                if answered is not None:
                    answered(i, results[i])
            if bar is not None:
                bar.advance(len(batch), sum(len(windows[i]) for i in batch))
        return results

    def _continuation_score(self, hidden: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        """score()'s answer from a window's decoder output [n, 1, H], its last len(continuation) positions
        predicting the continuation: their logits LOSS_CHUNK_TOKENS at a time (a rolling window's
        continuation is the whole window: a 64K window's logits, their fp32 copy and log-softmax
        would take 66 GB for a 100K vocabulary)."""
        log_likelihood, greedy = 0.0, True
        first = hidden.shape[0] - len(continuation)
        for start in range(0, len(continuation), LOSS_CHUNK_TOKENS):
            logits = self.model.output_logits(hidden[first + start:first + start + LOSS_CHUNK_TOKENS])[:, 0]
            log_probs = F.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(continuation[start:start + LOSS_CHUNK_TOKENS], device=log_probs.device)
            log_likelihood += float(log_probs.gather(1, target[:, None]).sum())
            greedy = greedy and bool((log_probs.argmax(-1) == target).all())
        return log_likelihood, greedy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, in windows of the model's length that predict every token once."""
        results = []
        with self.progress("rolling log-likelihoods", len(requests)) as bar:
            for (text,) in (request.args for request in requests):
                tokens = self.tok_encode(text, add_special_tokens=False)  # prefix_token_id starts the text
                windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)]
                results.append(sum(log_likelihood for log_likelihood, _ in self.score(windows)))
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), results[-1])
                bar.advance(1, len(tokens))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task asks) continuations, cut at the task's stop strings.
        Requests of one budget and sampling decode side by side, `batch_size` at a time, longest
        prompts first (so a batch's prompts differ little in length, and the first shows the memory
        needed)."""
        plans = [self._plan(*request.args) for request in requests]
        generators = request_generators(self.seed, requests)
        groups: dict[tuple, list[int]] = {}
        for index in sorted(range(len(plans)), key=lambda i: -len(plans[i].prompt)):
            groups.setdefault(plans[index].decoding, []).append(index)
        answers: list[str] = [""] * len(requests)
        with self.progress("generations", len(requests)) as bar:
            for members in groups.values():
                for start in range(0, len(members), self.batch_size):
                    batch = members[start:start + self.batch_size]
                    new = self._decode([plans[i] for i in batch], [generators[i] for i in batch])
                    for index, new_ids in zip(batch, new):
                        answers[index] = postprocess_generated_text(reply_text(self.tok, new_ids), plans[index].until,
                                                                    None)
                        self.cache_hook.add_partial("generate_until", requests[index].args, answers[index])
                        bar.advance(1, len(plans[index].prompt) + len(new_ids))
        return answers

    def _plan(self, context: str, gen_kwargs: dict) -> GenerationPlan:
        """What one request asks: its prompt ids, length, stop strings and sampling."""
        kwargs = generation_settings(gen_kwargs, self.max_gen_toks, self.max_length)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok.decode([self.eot_token_id]))
        max_new = kwargs.pop("max_gen_toks")
        # an empty context is conditioned on prefix_token_id, as in log-likelihoods
        prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
        temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
        return GenerationPlan(prompt, max_new, until, temperature, kwargs["top_k"], kwargs["top_p"])

    def _decode(self, plans: Sequence[GenerationPlan], generators: list[torch.Generator]) -> list[list[int]]:
        """The new ids of plans alike in their decoding, each plan's tokens drawn with its own generator."""
        max_new, temperature, top_k, top_p = plans[0].decoding
        return generate_batch(self.model, [plan.prompt for plan in plans], max_new, stop_ids=self.tok.eos_ids,
                              stops=[stop_texts_check(self.tok, plan.until) for plan in plans],
                              temperature=temperature, top_k=top_k, top_p=top_p, generator=generators)

    # the harness's collectives when it splits the requests among ranks
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return gather_across_ranks(tensor.reshape(-1))

    def gather_object(self, obj, dst: int = 0):
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return in_one_process_order(gathered) if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


_NONE = object()  # a rank with fewer documents has no item in the last round


def in_one_process_order(shares: list[dict]) -> list[dict]:
    """The ranks' per-document values, as the harness gathers them after scoring (each task's metric values
    keyed by (metric, filter), or its logged samples), put in the order one process has them. The harness
    chains the shares rank after rank, while rank r holds documents r, r + world, ... (its doc_iterator): a
    bootstrapped error bar (median, f1, mcc, bleu..., resampled by index with a fixed seed) then changed with
    the number of ranks, and --log-samples listed documents out of order. The values come interleaved back
    as the first share, the others left empty for the harness to chain."""
    merged: dict = {}
    for task, first in shares[0].items():
        per_rank = [share[task] for share in shares]
        if isinstance(first, dict):
            merged[task] = {key: _round_robin([values[key] for values in per_rank]) for key in first}
        else:  # logged samples: one filter's documents after another's
            filters = dict.fromkeys(sample["filter"] for sample in first)
            merged[task] = [sample for name in filters for sample in _round_robin(
                [[sample for sample in samples if sample["filter"] == name] for samples in per_rank])]
    empty = {task: {key: [] for key in values} if isinstance(values, dict) else [] for task, values in merged.items()}
    return [merged] + [empty] * (len(shares) - 1)


def _round_robin(shares: list[list]) -> list:
    """One item of each share in turn: share r's k-th item is document r + k * len(shares)."""
    return [item for one_round in itertools.zip_longest(*shares, fillvalue=_NONE) for item in one_round
            if item is not _NONE]


def request_generators(seed: int, requests) -> list[torch.Generator]:
    """Each generation request's sampling generator, of `seed` and the request alone: its task, document,
    index, arguments and which of its repeats it is (the harness passes a request once per repeat). A
    sampled answer is then the same whatever --batch-size, the order the requests come in, the number
    of ranks sharing them, or a --cache rerun (which answers sampled requests anew); one stream per
    rank gave each answer the draws its batch and share left it. Under torchrun the harness pads a
    shorter share with its last request's repeats once more, whose answers join that request's: they draw
    as the first ones, so that a vote over them (maj@k) elects what one process elects."""
    seen: Counter[str] = Counter()
    generators = []
    for request in requests:
        request_key = json.dumps([request.task_name, request.doc_id, request.idx, request.args], sort_keys=True,
                                 default=str)
        repeat = seen[request_key] % request.repeats if request.repeats else seen[request_key]
        generators.append(prompt_generator(seed, f"{request_key}#{repeat}"))
        seen[request_key] += 1
    return generators


@contextmanager
def few_shot_examples_as_one_process_draws() -> Iterator[None]:
    """lm-eval draws a task's few-shot examples from one seeded generator, a document after another, over
    the documents a rank builds the requests of (its own TODO: "need to offset doc_id by rank"): under
    torchrun a document was shown other examples than one process shows it, and scored otherwise. Here
    every rank builds every document's requests, drawing as one process does, and keeps those of the
    documents the harness gives it (every world-th from its rank on, by document id)."""
    build = Task.build_all_requests

    def built_as_one_process(task, *, rank: int = 0, world_size: int = 1, **kwargs) -> None:
        build(task, rank=0, world_size=1, **kwargs)
        task._instances = [instance for instance in task._instances if instance.doc_id % world_size == rank]
        if not task._instances:  # as lm-eval refuses a rank without documents (it pads with none)
            raise ValueError(f"{task.config.task}: rank {rank} of {world_size} has no documents to evaluate")

    Task.build_all_requests = built_as_one_process
    try:
        yield
    finally:
        Task.build_all_requests = build


@contextmanager
def bootstrap_in_this_process() -> Iterator[None]:
    """lm-eval bootstraps an error bar (median, f1, mcc, bleu...) in a multiprocessing pool forked from this
    process, which holds torch's thread pools (and the ranks' process group): a forked worker could hang on a
    lock a thread held at the fork, and the run with it (seen under CI's load). Its serial path draws the same
    resamples (a generator seeded by the chunk, chunk after chunk), so the error bars are the same."""
    before = os.environ.get(LM_EVAL_SERIAL_BOOTSTRAP)
    os.environ[LM_EVAL_SERIAL_BOOTSTRAP] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[LM_EVAL_SERIAL_BOOTSTRAP]
        else:
            os.environ[LM_EVAL_SERIAL_BOOTSTRAP] = before


LM_EVAL_SERIAL_BOOTSTRAP = "DISABLE_MULTIPROC"  # lm_eval.api.metrics.bootstrap_stderr's switch


def require_harness() -> None:
    if HARNESS_MISSING:
        raise MegadiffError("lm-evaluation-harness is not installed: pip install 'megadiff[eval]' (or lm_eval)")


HUB_PROBE_TIMEOUT_S = 5


def known_tasks(tasks: Sequence[str], include_path: str | None) -> tuple[TaskManager, list[str]]:
    """The harness's task index and the task names that `tasks` (names or glob patterns) match,
    after checking that each matches one (before the checkpoint is read). Tasks all found under
    `include_path` skip indexing the harness's own thousands (some 10 s)."""
    if include_path and not Path(include_path).is_dir():  # the harness ignores it then, its tasks "unknown"
        raise ConfigError(f"--include-path {include_path} is no directory: give the directory of the task YAML files")
    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(own.match_tasks([task]) for task in tasks):
            return own, own.match_tasks(list(tasks))
    manager = TaskManager(include_path=include_path)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        raise ConfigError(f"lm-eval knows no task {unknown} (`lm_eval ls tasks` lists them; --include-path adds "
                          "a directory of task YAML files)")
    return manager, manager.match_tasks(list(tasks))


def read_hub_data_from_cache_if_unreachable() -> None:
    """Without a network, and without HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1), the datasets library
    retries the hub for some 20 s a task before reading its cache: one request that gets no answer turns
    both libraries' offline mode on instead, for this process (any HTTP status is an answer). The ranks of a
    joined group decide together, rank 0 asking for all, and all go offline where any rank already is: ranks
    deciding apart could read different revisions of a task's data (the hub's newest, the cache's), and each
    rank scores its share of the requests."""
    import datasets
    import huggingface_hub

    rank, world = rank_and_world()
    offline = [bool(datasets.config.HF_HUB_OFFLINE)] * world
    if world > 1:  # every rank joins every collective here, whatever its own setting
        dist.all_gather_object(offline, offline[rank])
    if all(offline):
        return
    endpoint = huggingface_hub.constants.ENDPOINT
    if any(offline):
        why = f"HF_HUB_OFFLINE=1 on ranks {[r for r, own in enumerate(offline) if own]} alone"
    else:
        unanswered = [_why_unanswered(endpoint) if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(unanswered, src=0)
        if unanswered[0] is None:
            return
        why = f"the hub ({endpoint}) does not answer ({unanswered[0]})"
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    plain_console(stderr=True, quiet=rank != 0).print(
        f"{why}: the tasks' data is read from the datasets cache only (HF_HUB_OFFLINE=1 says so without asking)")


def _why_unanswered(endpoint: str) -> str | None:
    """Why a HEAD request to `endpoint` got no answer; None where it got one, whatever its status."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        pass
    except OSError as error:  # DNS, refused, a timeout, a proxy that cannot connect
        return str(getattr(error, "reason", error))
    return None


def check_task_data(manager: TaskManager, names: list[str]) -> None:
    """Builds the tasks once before the checkpoint is read: each reads its data from the hub or the
    datasets cache, so data that cannot be had (offline, a missing file) is refused by name rather than
    after minutes of loading; the evaluation then builds them again from the cache."""
    import datasets

    read_hub_data_from_cache_if_unreachable()
    try:
        get_task_dict(names, manager)
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
        raise ConfigError(f"lm-eval cannot read the data of the tasks {names}: {error} (without a network, the "
                          "datasets cache must hold it: HF_DATASETS_CACHE)") from None


def quantize_attention_logits(model: CausalLM, bits: int | None) -> None:
    """Every layer's core attention quantizes its logits to `bits` (None: as trained)."""
    for layer in model.gpt.decoder.layers:
        layer.self_attention.core_attention.attention_logit_bits = bits


def keep_cache_request(cache: str, request: dict) -> None:
    """`--cache PATH`: the harness's CachingLM keys the answers it keeps (PATH_rankN.db) on the requests'
    text alone, so the model and settings they are answered with are recorded beside them
    (PATH.request.json) and a rerun asking otherwise is refused before any request runs, rather than
    given another model's answers. A cache kept before requests were recorded is taken as this
    request's (nothing says otherwise), which is recorded from then on."""
    request_file = Path(f"{cache}.request.json")
    # every rank has read the file before rank 0 writes it (the check is collective), so all decide alike
    recorded = refused_together(lambda: _checked_cache_request(cache, request_file, request))
    if not recorded and reports():
        if glob.glob(f"{glob.escape(cache)}_rank*.db"):  # as simple_evaluate names them
            command_console().print(f"lm-eval: {cache} holds answers kept before caches recorded their request: "
                                    f"taken as this request's, recorded in {request_file}")
        write_atomically(request_file, json.dumps(request, indent=1).encode())
    wait_for_ranks()  # the request is on disk before any rank keeps an answer


def _checked_cache_request(cache: str, request_file: Path, request: dict) -> bool:
    """Whether `request_file` records `request` (False: it records none); another request is refused."""
    if not request_file.is_file():
        return False
    recorded = json.loads(request_file.read_text())
    differences = [f"{CACHE_REQUEST_OPTIONS[key]} ({key}): {recorded.get(key)!r} there, {value!r} here"
                   for key, value in request.items() if recorded.get(key) != value]
    if differences:
        raise ConfigError(f"--cache {cache} holds the answers of another request ({'; '.join(differences)}): "
                          "give this one another --cache")
    return True


def lm_eval_cli(load: str, tasks: Sequence[str], num_fewshot: int | None = None, limit: float | None = None,
                batch_size: int = 8, include_path: str | None = None, seed: int = 1234, dtype: str | None = None,
                attention_logit_bits: int | None = None, output: str | None = None, log_samples: bool = False,
                cache: str | None = None, gen_kwargs: str | None = None, apply_chat_template: bool = False,
                system_instruction: str | None = None, fewshot_as_multiturn: bool = False) -> int:
    """`megadiff lm-eval --load RUN --tasks ...`: print the harness's table (and write its results).
    With `cache`, the harness's CachingLM keeps each answer in CACHE_rankN.db as it is computed: a
    rerun (after a crash or preemption) computes only the rest; one asking otherwise is refused
    (keep_cache_request). `gen_kwargs` ("max_gen_toks=1024,...") overrides the generation tasks' own
    settings, as lm_eval's --gen_kwargs does."""
    require_harness()
    if batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if fewshot_as_multiturn and not apply_chat_template:
        raise ConfigError("--fewshot-as-multiturn writes the few-shot examples as chat turns: "
                          "add --apply-chat-template")
    if attention_logit_bits is not None and attention_logit_bits < 2:
        raise ConfigError("--attention-logit-bits must be >= 2 (a sign and one level)")
    if log_samples and not output:
        raise ConfigError("--log-samples writes every request's answer into --output: give one")
    manager, names = known_tasks(tasks, include_path)
    init_process_group(timedelta(minutes=30))  # under torchrun: the ranks join, so that they read the same data
    check_task_data(manager, names)
    if gen_kwargs:  # before any request runs (a task's own settings are checked as its requests come)
        window = checkpoint_config(resolve_checkpoint_dir(load)).model.seq_length
        generation_settings(simple_parse_args_string(gen_kwargs), default_max_gen_toks=1, window=window)
    model = load_checkpoint(load, PRECISION_DTYPES[dtype] if dtype else None)  # under torchrun: joins the ranks
    quantize_attention_logits(model, attention_logit_bits)
    chat_template = checkpoint_chat_template(model, "--apply-chat-template") if apply_chat_template else None
    if cache:
        keep_cache_request(cache, {
            "checkpoint": str(Path(model.checkpoint_dir).resolve()), "dtype": str(model.dtype),
            "attention_logit_bits": attention_logit_bits,
            "chat_template": hashlib.sha256(chat_template.encode()).hexdigest()[:16] if chat_template else None,
            "system_instruction": system_instruction, "fewshot_as_multiturn": fewshot_as_multiturn,
            "gen_kwargs": simple_parse_args_string(gen_kwargs) if gen_kwargs else None,
            # contexts begin with it (before, caches recorded none: they were answered without it)
            **({"text_start": list(model.tokenizer.text_start)} if model.tokenizer.text_start else {})})
    with few_shot_examples_as_one_process_draws(), bootstrap_in_this_process():
        results = simple_evaluate(
            model=MegadiffLM(model, batch_size=batch_size, chat_template=chat_template, seed=seed), tasks=names,
            num_fewshot=num_fewshot, limit=limit, task_manager=manager, log_samples=log_samples, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed, use_cache=cache,
            gen_kwargs=gen_kwargs, apply_chat_template=apply_chat_template, system_instruction=system_instruction,
            fewshot_as_multiturn=fewshot_as_multiturn)
    if not reports():
        return 0
    console = command_console()
    logits = f", attention logits in {attention_logit_bits} bits" if attention_logit_bits else ""
    generation = f", generation {gen_kwargs}" if gen_kwargs else ""
    chat = ", as chat" + (" (few-shot as turns)" if fewshot_as_multiturn else "") if apply_chat_template else ""
    console.print(f"{model.checkpoint_dir}: lm-eval, {num_fewshot or 0}-shot{logits}{generation}{chat}")
    console.print(make_table(results))
    if "groups" in results:
        console.print(make_table(results, "groups"))
    if output:
        kept = {key: results[key] for key in ("results", "groups", "n-shot", "versions", "samples") if key in results}
        kept.update(checkpoint=str(model.checkpoint_dir), attention_logit_bits=attention_logit_bits,
                    gen_kwargs=gen_kwargs, chat_template=chat_template, system_instruction=system_instruction,
                    fewshot_as_multiturn=fewshot_as_multiturn)
        write_atomically(output, json.dumps(kept, indent=1, default=handle_non_serializable).encode())
        console.print(f"wrote {output}")
    return 0
