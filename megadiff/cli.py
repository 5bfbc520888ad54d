"""`megadiff` command line: parses arguments and calls into the package, nothing more."""
from __future__ import annotations

import argparse
import codecs
import errno
import importlib
import locale
import logging
import math
import os
import select
import sys
import warnings
from typing import Callable

from megadiff import __version__

# what --dtype may ask of a checkpoint's weights (the CLI imports nothing heavy to check it)
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")


def _target(path: str) -> Callable:
    """'package.module:function' -> the function, its module imported only now (a command loads what it runs)."""
    module_name, func_name = path.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def _options(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names}


def _number(text: str, kind: type = float):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None


def _positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _count(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def _positive(meaning: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0, refused as not `meaning` otherwise."""
    def positive(text: str) -> float:
        value = _number(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not {meaning} (a number > 0)")
        return value
    return positive


def _output_file(text: str) -> str:
    """Checked as the command is read: a directory given was found only when the finished report was written."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the file to write")
    return text


class _Override(str):
    """A key=value override an option's list of numbers took in (`--lengths 64 128 data.prefix=X`): argparse's
    nargs="+" takes every argument up to the next option."""


def _numbers(kind: type) -> Callable[[str], object]:
    """A number of `kind`, or an override that ends the list (parse_arguments gives it back to the overrides)."""
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            if "=" in text:
                return _Override(text)
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    return parse


def _config_command(sub, name: str, target: str, help_text: str, options: tuple[str, ...] = ()):
    """A command on a config and its overrides; `options`: the arguments, added by the caller, it passes on."""
    parser = sub.add_parser(name, help=help_text)
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.set_defaults(run=lambda a: _target(target)(a.config, a.overrides, **_options(a, options)))
    return parser


def _model_source(parser: argparse.ArgumentParser) -> None:
    """--load a megadiff checkpoint, or --hf a transformers model (e.g. a Dex/DAA export)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a run's output_dir, checkpoints/ or iter_* directory")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory instead (an adapted or exported "
                        "model, or the one it was adapted from)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="--hf: run code of the directory's own that megadiff did not ship (its config's "
                        "auto_map; an earlier megadiff's export), which is refused otherwise")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="default: the checkpoint's training precision (--hf: its config's dtype)")
    parser.add_argument("--window", type=int, default=None,
                        help="--hf: the context the model is measured in (default: its max_position_embeddings)")


def _checkpoint_command(sub, name: str, help_text: str, hf: bool = False) -> argparse.ArgumentParser:
    """A command that reads a checkpoint (with `hf`, or a transformers model) and text it never
    trained on (its validation split by default)."""
    parser = sub.add_parser(name, help=help_text)
    if hf:
        _model_source(parser)
    else:
        parser.add_argument("--load", required=True, help="a run's output_dir, checkpoints/ or iter_* directory")
    parser.add_argument("--split", choices=["valid", "test"], default="valid")
    parser.add_argument("--output", type=_output_file, default=None, help="write the report as JSON here")
    parser.add_argument("overrides", nargs="*", help="data.* overrides, e.g. data.prefix=... to use other data")
    return parser


def _sampling_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: 1 = every id")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="default: the checkpoint's training precision")


def _held_out_command(sub, name: str, help_text: str, hf: bool = False) -> argparse.ArgumentParser:
    """A checkpoint command over held-out samples cut as training cuts them."""
    parser = _checkpoint_command(sub, name, help_text, hf)
    parser.add_argument("--seq-length", type=int, default=None, help="default: the checkpoint's model.seq_length")
    parser.add_argument("--sequences", type=int, default=16, help="samples (of each source of a blend)")
    parser.add_argument("--batch-size", type=int, default=1)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megadiff", description=__doc__)
    parser.add_argument("--version", action="version", version=f"megadiff {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = _config_command(sub, "prepare-data", "megadiff.data.prepare:prepare_from_config",
                              "tokenize text into a megatron indexed dataset (.bin/.idx)", options=("part",))
    prepare.add_argument("--part", metavar="I/N", help="tokenize only every N-th source file, starting at the I-th "
                         "(0-based), for N processes or nodes sharing the work; then run without --part to merge")
    _config_command(sub, "pretrain", "megadiff.training.pretrain:pretrain_from_config",
                    "pre-train (one process or under torchrun)")
    _config_command(sub, "adapt", "megadiff.adapt.finetune:finetune_from_config",
                    "Dex/DAA adaptation of a HF model with DeepSpeed ZeRO")

    params = sub.add_parser("params", help="print a config's parameter count without allocating it")
    params.add_argument("config")
    params.add_argument("overrides", nargs="*")
    params.add_argument("--world-size", type=_positive_int, default=None,
                        help="GPUs of the run, for the per-GPU memory (default: TP x PP x CP, one replica)")
    params.add_argument("--fit", type=_positive("a GPU's memory in GiB"), default=None, metavar="GIB",
                        help="also list the tensor/pipeline/recompute layouts whose estimated peak fits GIB per GPU")
    params.set_defaults(run=lambda a: _target("megadiff.models.param_count:print_param_count")(
        a.config, a.overrides, world_size=a.world_size, fit_gib=a.fit))

    convert = sub.add_parser("convert", help="convert checkpoints to and from Hugging Face format")
    conv_sub = convert.add_subparsers(dest="direction", required=True)
    for direction, target, options in (("to-hf", "megadiff.convert.to_hf:convert_to_hf", ("remote_code",)),
                                       ("from-hf", "megadiff.convert.from_hf:convert_from_hf", ("pad_vocab",))):
        p = conv_sub.add_parser(direction)
        p.add_argument("--load", required=True, help="source directory")
        p.add_argument("--save", required=True, help="destination directory")
        p.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                       help="weight dtype of the output (default: keep the source's)")
        p.add_argument("--no-check", action="store_true", help="skip the logits comparison of both sides")
        p.set_defaults(run=lambda a, t=target, o=options: _target(t)(a.load, a.save, dtype=a.dtype,
                                                                     check=not a.no_check, **_options(a, o)))
    conv_sub.choices["to-hf"].add_argument(
        "--remote-code", action="store_true",
        help="export DIFF with megadiff's modeling code (trust_remote_code) instead of stock DiffLlama")
    conv_sub.choices["from-hf"].add_argument(
        "--pad-vocab", type=_positive_int, default=None, metavar="MULTIPLE",
        help="pad the vocabulary's rows to a multiple of MULTIPLE (e.g. 128) for tensor-parallel training, the new "
             "rows the old ones' mean (default: keep it as it is)")

    gen = sub.add_parser("generate", help="generate text from a megadiff checkpoint")
    gen.add_argument("--load", required=True)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-file", help="the prompt's text from a file ('-': standard input), e.g. a long "
                        "context")
    prompt.add_argument("--prompts", metavar="FILE", help="a JSON-lines file of prompts ({\"prompt\": ...}, or with "
                        "--chat {\"messages\": [...]}); completions go to --output, in batches, resumable")
    gen.add_argument("--output", type=_output_file, default=None, metavar="OUT",
                     help="with --prompts: the completions, as JSON lines")
    gen.add_argument("--batch-size", type=int, default=None,
                     help="with --prompts: prompts decoded side by side (default: 8)")
    _sampling_options(gen, max_new_tokens=32)
    gen.add_argument("--chat", action="store_true", help="the prompt is a user's message to a chat-tuned checkpoint, "
                     "rendered by its chat template; prints the assistant's reply")
    gen.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system turn first")
    gen.set_defaults(run=lambda a: _target("megadiff.inference.generate_file:generate_file_cli")(
        a.load, a.prompts, a.output, chat=a.chat, system=a.system, max_new_tokens=a.max_new_tokens,
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, dtype=a.dtype,
        batch_size=8 if a.batch_size is None else a.batch_size)
        if a.prompts else _target("megadiff.inference.generate:generate_cli")(
        a.load, a.prompt, prompt_file=a.prompt_file, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
        top_k=a.top_k, top_p=a.top_p, seed=a.seed, dtype=a.dtype, chat=a.chat, system=a.system, output=a.output,
        batch_size=a.batch_size))

    chat = sub.add_parser("chat", help="talk to a chat-tuned checkpoint: a message per line of standard input")
    chat.add_argument("--load", required=True)
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system turn first")
    _sampling_options(chat, max_new_tokens=256)
    chat.set_defaults(run=lambda a: _target("megadiff.inference.chat:chat_cli")(
        a.load, system=a.system, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
        top_p=a.top_p, seed=a.seed, dtype=a.dtype))

    evaluate = _held_out_command(sub, "evaluate", "held-out loss of a checkpoint, overall and by position", hf=True)
    evaluate.add_argument("--buckets", type=int, default=8, help="position buckets of the report")
    evaluate.add_argument("--frequent-bigrams", type=float, default=None, metavar="PER_MILLION",
                          help="Zoology's AR-hit filter: a bigram at least this frequent in the training split "
                               "(per million bigrams) is not an AR hit")
    evaluate.add_argument("--bigram-sample-tokens", type=int, default=None,
                          help="training tokens counted for --frequent-bigrams (default 100M, spread over the split)")
    evaluate.set_defaults(run=lambda a: _target("megadiff.inference.evaluate:evaluate")(
        a.load, split=a.split, seq_length=a.seq_length, sequences=a.sequences, batch_size=a.batch_size,
        buckets=a.buckets, overrides=a.overrides, output=a.output, frequent_bigrams=a.frequent_bigrams,
        bigram_sample_tokens=a.bigram_sample_tokens, hf=a.hf, dtype=a.dtype, window=a.window))
    outliers = _held_out_command(sub, "outliers", "largest attention logits and hidden states of a checkpoint "
                                 "(the DIFF paper's activation outliers)", hf=True)
    needles = _checkpoint_command(sub, "needles", "multi-needle retrieval accuracy by context length and depth "
                                  "(haystack: the split's text)", hf=True)
    needles.add_argument("--lengths", type=_numbers(int), nargs="+", required=True, help="context lengths in tokens")
    needles.add_argument("--depths", type=_numbers(float), nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                         help="where the queried needle sits: 0 = start, 1 = end")
    needles.add_argument("--needles", type=int, default=1, help="needles in each context (the paper's N)")
    needles.add_argument("--queries", type=int, default=1,
                         help="how many of them the question asks for (the paper's R); a case scores the share found")
    needles.add_argument("--trials", type=int, default=5, help="cases per length and depth")
    needles.add_argument("--seed", type=int, default=0)
    needles.add_argument("--attention", action="store_true",
                         help="also the attention to the answer and the attention noise (the paper's Table 3)")
    needles.set_defaults(run=lambda a: _target("megadiff.inference.needles:needles_cli")(
        a.load, a.lengths, a.depths, needles=a.needles, trials=a.trials, seed=a.seed, split=a.split,
        attention=a.attention, overrides=a.overrides, output=a.output, queries=a.queries, hf=a.hf, dtype=a.dtype,
        window=a.window))
    outliers.set_defaults(run=lambda a: _target("megadiff.inference.outliers:outliers")(
        a.load, split=a.split, seq_length=a.seq_length, sequences=a.sequences, batch_size=a.batch_size,
        overrides=a.overrides, output=a.output, hf=a.hf, dtype=a.dtype, window=a.window))

    harness = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on a checkpoint (the papers' zero-shot "
                             "tables), no conversion")
    harness.add_argument("--load", required=True, help="a run's output_dir, checkpoints/ or iter_* directory")
    harness.add_argument("--tasks", nargs="+", required=True,
                         help="lm-eval task names or patterns, e.g. arc_easy arc_challenge boolq hellaswag openbookqa "
                         "piqa winogrande")
    harness.add_argument("--num-fewshot", type=_count, default=None)
    harness.add_argument("--limit", type=_positive("a number of documents, or a fraction of them"), default=None,
                         help="documents per task (a fraction when < 1)")
    harness.add_argument("--batch-size", type=int, default=8)
    harness.add_argument("--include-path", default=None, help="a directory of your own task YAML files")
    harness.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                         help="default: the checkpoint's training precision")
    harness.add_argument("--seed", type=int, default=1234, help="few-shot sampling and the harness's generators")
    harness.add_argument("--attention-logit-bits", type=int, default=None, metavar="B",
                         help="quantize the attention logits to B bits (the DIFF paper's Figure 8; materialises "
                         "the attention maps)")
    harness.add_argument("--gen-kwargs", default=None, metavar="K=V,...",
                         help="generation settings over the tasks' own, e.g. max_gen_toks=1024 (the DIFF paper's "
                         "math evaluations restrict the output to 1K and 16K tokens)")
    harness.add_argument("--apply-chat-template", action="store_true",
                         help="ask as a conversation, with the chat template the checkpoint was fine-tuned on "
                         "(data.chat_template, else its tokenizer's)")
    harness.add_argument("--system-instruction", default=None, metavar="TEXT", help="a system turn before each request")
    harness.add_argument("--fewshot-as-multiturn", action="store_true",
                         help="with --apply-chat-template: each few-shot example as a user and an assistant turn")
    harness.add_argument("--output", type=_output_file, default=None, help="write the results as JSON here")
    harness.add_argument("--log-samples", action="store_true", help="with --output: every request and its answer")
    harness.add_argument("--cache", default=None, metavar="PATH",
                         help="keep every answer in PATH_rankN.db as it is computed; a rerun computes only the rest "
                         "(one asking for another model or settings is refused)")
    harness.set_defaults(run=lambda a: _target("megadiff.inference.harness:lm_eval_cli")(
        a.load, a.tasks, num_fewshot=a.num_fewshot, limit=a.limit, batch_size=a.batch_size,
        include_path=a.include_path, seed=a.seed, dtype=a.dtype, attention_logit_bits=a.attention_logit_bits,
        output=a.output, log_samples=a.log_samples, cache=a.cache, gen_kwargs=a.gen_kwargs,
        apply_chat_template=a.apply_chat_template, system_instruction=a.system_instruction,
        fewshot_as_multiturn=a.fewshot_as_multiturn))

    judge = sub.add_parser("hallucination", help="a judge model's verdicts on generated outputs in harness sample "
                           "logs (the DIFF paper's contextual-hallucination table)")
    judge.add_argument("samples", nargs="+", help="`megadiff lm-eval --log-samples --output` JSON files or lm_eval's "
                       "samples_TASK_DATE.jsonl files")
    judge.add_argument("--judge-url", required=True, help="an OpenAI-compatible API, e.g. https://api.openai.com/v1")
    judge.add_argument("--judge-model", required=True, help="e.g. gpt-4o (the paper's judge)")
    judge.add_argument("--api-key-env", default="OPENAI_API_KEY", help="the environment variable holding the API key")
    judge.add_argument("--workers", type=int, default=4, help="requests in flight at once")
    judge.add_argument("--records", default=None,
                       help="verdicts, appended as they arrive and reused by reruns (default: next to the first "
                       "samples file, .judgments.jsonl)")
    judge.add_argument("--output", type=_output_file, default=None, help="write the accuracy per task as JSON here")
    judge.set_defaults(run=lambda a: _target("megadiff.inference.hallucination:hallucination_cli")(
        a.samples, a.judge_url, a.judge_model, api_key_env=a.api_key_env, workers=a.workers, records=a.records,
        output=a.output))

    scaling = sub.add_parser("scaling", help="fit the runs' validation losses by model size or training tokens and "
                             "match each variant to the baseline's curve (the DIFF paper's figure 3)")
    scaling.add_argument("runs", nargs="+", help="the runs' output_dir (config.yaml and metrics.jsonl)")
    scaling.add_argument("--by", choices=["params", "tokens"], default="params",
                         help="params: each run's last loss against its size; tokens: every loss a run logged "
                         "against the tokens trained on by then")
    scaling.add_argument("--metric", default="valid_loss", help="a metrics.jsonl key, e.g. valid_loss/NAME")
    scaling.add_argument("--baseline", default="softmax", help="the variant whose curve the others are matched to")
    scaling.add_argument("--at", action="append", default=[], metavar="X",
                         help="also match this size (token count) on each variant's curve, e.g. 7.8B (repeatable)")
    scaling.add_argument("--from", dest="start", default=None, metavar="X",
                         help="fit only points at X or more (e.g. 40B tokens: leave out the first evaluations)")
    scaling.add_argument("--output", type=_output_file, default=None, help="write the fits and matches as JSON here")
    scaling.set_defaults(run=lambda a: _target("megadiff.analysis.scaling:scaling_cli")(
        a.runs, by=a.by, metric=a.metric, baseline=a.baseline, at=a.at, start=a.start, output=a.output))

    icl = sub.add_parser("icl", help="many-shot in-context classification by number of demonstrations (the DIFF "
                         "paper's figures 6-7)")
    _model_source(icl)
    icl.add_argument("--dataset", required=True, help="a Hugging Face dataset (e.g. CogComp/trec, PolyAI/banking77, "
                     "clinc_oos) or a directory of TRAIN.jsonl and TEST.jsonl")
    icl.add_argument("--dataset-config", default=None, help="the dataset's configuration (clinc_oos: plus)")
    icl.add_argument("--text-key", default="text")
    icl.add_argument("--label-key", default="label", help="e.g. coarse_label, fine_label (TREC), intent (clinc_oos)")
    icl.add_argument("--train-split", default="train", help="where demonstrations are drawn from")
    icl.add_argument("--test-split", default="test")
    icl.add_argument("--shots", type=_numbers(int), nargs="+", default=None,
                     help="demonstration counts (default: 1, 2, 4, ... up to the most that fit the window)")
    icl.add_argument("--examples", type=int, default=100, help="test examples (a seeded sample)")
    icl.add_argument("--orders", type=int, default=1, help="seeded orders of the same demonstrations (robustness)")
    icl.add_argument("--arrangement", choices=["random", "by-class"], default="random")
    icl.add_argument("--seed", type=int, default=0, help="the draw of demonstrations and test examples")
    icl.add_argument("--output", type=_output_file, default=None, help="write the report as JSON here")
    icl.add_argument("--cache", default=None, metavar="PATH",
                     help="keep every answer in PATH_rankN.jsonl as it comes; a rerun computes only the rest")
    icl.set_defaults(run=lambda a: _target("megadiff.inference.icl:icl_cli")(
        a.load, a.dataset, a.dataset_config, text_key=a.text_key, label_key=a.label_key, train_split=a.train_split,
        test_split=a.test_split, shots=a.shots, examples=a.examples, orders=a.orders, arrangement=a.arrangement,
        seed=a.seed, output=a.output, cache=a.cache, hf=a.hf, dtype=a.dtype, window=a.window))

    demo = sub.add_parser("demo", help="prepare the bundled corpus, pre-train a tiny DIFF model, convert, sample")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("overrides", nargs="*", help="key.sub=value overrides of configs/demo/diff-tiny.yaml")
    demo.set_defaults(run=lambda a: _target("megadiff.demo:run_demo")(a.output_dir, a.overrides))
    return parser


# megatron-core warns at import that it falls back from TransformerEngine/Apex to torch: expected
# without them (the CPU machines), and said once in the README rather than on every command.
QUIET_IMPORT_WARNINGS = r".*(Transformer Engine|Apex)( and Apex)? (is|are) not installed.*"


def _quiet_library_warnings() -> None:
    """Deprecation notices between torch, megatron-core and transformers address their developers,
    not ours; subprocesses (dist_checkpointing's workers) inherit the setting."""
    warnings.filterwarnings("ignore", message=QUIET_IMPORT_WARNINGS)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    # torchao (imported by transformers when installed) reports CUDA-only extensions it cannot load on a CPU
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """build_parser()'s parse_args, but overrides may also come after options (`params CONFIG --world-size 64
    parallel.tensor=2`): argparse ends a command's positionals at its first option and refuses the rest."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    rest = [*_overrides_taken_by_lists(parser, args), *rest]
    if rest and hasattr(args, "overrides") and not any(item.startswith("-") for item in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def _overrides_taken_by_lists(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The overrides a list of numbers took in (_numbers), taken out of it: `needles --lengths 64 128
    data.prefix=X` was refused as an invalid int, the override read as one of the lengths."""
    taken = []
    for option, values in vars(args).items():
        if isinstance(values, list) and any(isinstance(value, _Override) for value in values):
            taken += [value for value in values if isinstance(value, _Override)]
            numbers = [value for value in values if not isinstance(value, _Override)]
            if not numbers:
                parser.error(f"argument --{option.replace('_', '-')}: expected at least one number before "
                             f"{taken[-1]}")
            setattr(args, option, numbers)
    return [str(value) for value in taken]


SIGPIPE_EXIT_CODE = 141  # the shell's code for a command SIGPIPE ended
TRAINING_COMMANDS = ("pretrain", "adapt")


def main(argv: list[str] | None = None) -> int:
    _quiet_library_warnings()
    args = parse_arguments(argv)
    from megadiff.console import when_the_reader_goes
    with when_the_reader_goes(_when_the_reader_goes(args)):
        return _run(args)


def _when_the_reader_goes(args: argparse.Namespace) -> str:
    """What the command does once the reader of its output went away (megadiff.console's _reader_gone)."""
    from megadiff.console import ENDS, FINISHES, GOES_ON
    if args.command in TRAINING_COMMANDS:
        return GOES_ON
    return FINISHES if getattr(args, "output", None) else ENDS


def _run(args: argparse.Namespace) -> int:
    """The command `args` names, its errors said in a line each (with the exit code they give)."""
    from megadiff.config import ConfigError
    from megadiff.console import OutputReaderGone, output_reader_went_away, silence_standard_output
    from megadiff.errors import MegadiffError
    try:
        if getattr(args, "hf", None) is not None:  # before transformers can run any of its code
            _target("megadiff.inference.remote_code:check_remote_code")(args.hf, args.trust_remote_code)
        result = args.run(args)
    except ConfigError as err:
        print(f"megadiff: config error: {err}", file=sys.stderr)
        return 2
    except MegadiffError as err:  # a checkpoint, conversion or run that cannot go on, explained
        print(f"megadiff {args.command}: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C: the user knows where; a traceback into torch or transformers says nothing
        print(f"megadiff {args.command}: interrupted", file=sys.stderr)
        return 130  # the shell's code for a command SIGINT ended
    except BrokenPipeError as err:
        if not isinstance(err, OutputReaderGone) and not _stdout_reader_gone():
            raise
        # its reader went away (`generate ... | head`): what it printed was all that was wanted
        silence_standard_output()
        return SIGPIPE_EXIT_CODE
    except OSError as err:
        if err.errno not in STORAGE_ERRORS:  # anything else is a bug, whose traceback says where
            raise
        # a write() names no file
        where = f": {err.filename}{_named_by(err.filename)}" if err.filename else " (writing its output)"
        print(f"megadiff {args.command}: {err.strerror}{where}", file=sys.stderr)
        return 3
    if output_reader_went_away():  # a report file, or the other ranks' work, finished first
        return SIGPIPE_EXIT_CODE
    return result if isinstance(result, int) else 0


# where libraries write their caches: a path refused under one of them is the variable's doing
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME")


def _named_by(path) -> str:
    for name in CACHE_VARIABLES:
        value = os.environ.get(name, "").rstrip("/")
        if value and (str(path) == value or str(path).startswith(value + "/")):
            return f" (from ${name}: point it at a directory you can write)"
    return ""


def _stdout_reader_gone() -> bool:
    """Standard output is a pipe whose reading end is closed."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR is reported whatever the mask
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # a standard output without a file (captured, a notebook's)
        return False


# what the machine refused, not megadiff: a full disk, a quota, a read-only mount, permissions, and an output
# path through (or onto) an existing file
STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST}


def entry_point(argv: list[str] | None = None) -> int:
    """The `megadiff` program: main(), then the process group a finished command formed released. An
    inference command leaves its group for later calls in the same process (in-process callers of
    main() keep their loaded models); left to the interpreter's exit, NCCL warns of it and may hang there."""
    if argv is None:
        run_in_utf8_mode()
    formed_before = _process_group_formed()
    code = main(argv)
    if code == 0 and _process_group_formed() and not formed_before:
        _target("megadiff.parallel:shutdown")()
    return code


def run_in_utf8_mode() -> None:
    """megadiff's files, prompts and outputs are UTF-8, and so are torch's own templates: under a locale of another
    encoding (LC_ALL=C with PYTHONUTF8=0, a Latin-1 locale) Python reads and writes them in that one, and every
    command failed on the first non-ASCII byte (in torch's import). Then the same command again, in Python's UTF-8
    mode, as are the processes it starts."""
    if sys.flags.utf8_mode or codecs.lookup(locale.getpreferredencoding(False)).name == "utf-8":
        return
    os.environ["PYTHONUTF8"] = "1"
    os.execv(sys.executable, [sys.executable, "-X", "utf8", *sys.orig_argv[1:]])


def _process_group_formed() -> bool:
    distributed = sys.modules.get("torch.distributed")  # not imported: no group, and no import to pay for
    return distributed is not None and distributed.is_available() and distributed.is_initialized()


if __name__ == "__main__":
    sys.exit(entry_point())
