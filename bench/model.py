"""Whole-model training throughput: DIFF vs the equal-size softmax Transformer, and FP8 vs BF16.

    python bench/model.py                        # CUDA: 8 layers of the DIFF-3B recipe
    python bench/model.py --device cpu --small   # a tiny run that checks the script itself

Every run goes through megadiff's real training step (build_engine + train_step: megatron's
schedule, DDP, the Adam optimizer) on synthetic token batches, one process, one device. Runs:
the DIFF model and the softmax model of the same hidden size, layers and batch (twice the heads,
half the head width), in BF16, then each in FP8 through torch-native float8 linears
(train.fp8_backend=torchao); --diff-backends runs the DIFF model once per attention backend. Reported
per run: tokens/s, TFLOP/s per device and MFU (matmul FLOPs from megadiff.models.param_count, peak from
--peak-tflops or the device's known dense BF16 peak), peak memory, the SDPA kernels its attention ran,
and the loss of every step. Results: bench/results/model-<device>-<date>.{json,md}.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(ROOT))

from bench.report import (  # noqa: E402
    OUT_DIR_HELP, cuda_missing, default_out_dir, environment, kernel_times_ms, kernels_ran, markdown_table, software,
    synchronize, tiles_tuned_here, timed_ms, write,
)
from megadiff.config import Config, load_config, resolved_head_dim  # noqa: E402
from megadiff.models.param_count import count_parameters, training_flops_per_token  # noqa: E402
from megadiff.ops import resolve_backend  # noqa: E402
from megadiff.ops.sdpa import recording_sdpa_kernels  # noqa: E402
from megadiff.parallel import initialize, shutdown  # noqa: E402
from megadiff.parallel.initialize import set_seed  # noqa: E402
from megadiff.training.engine import build_engine  # noqa: E402
from megadiff.training.pretrain import build_scheduler  # noqa: E402
from megadiff.training.step import train_step  # noqa: E402
from megadiff.training.throughput import device_peak_tflops  # noqa: E402

# The DIFF-3B recipe (hidden 3072, 12 DIFF heads of d=128, V 256, SwiGLU 8192, cl100k vocabulary,
# N=4096) cut to 8 of its 28 layers: 1.5B parameters, which train on one 80 GB GPU. No activation
# recompute: it fits, and recomputing the fused attention would only blur the comparison.
RECIPE = ROOT / "configs" / "diff-3b.yaml"
RECIPE_SLICE = ["model.num_layers=8", "train.recompute=none"]
SMALL_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
               "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
               "model.seq_length=32", "model.attention_backend=sdpa"]
PRECISIONS = {"bf16": ["train.precision=bf16"],
              "fp8": ["train.precision=fp8", "train.fp8_backend=torchao"]}
CHILD_EXIT_TIMEOUT_S = 120  # a run's process still tearing down after this is stuck (its row is already in)
ZIPF_EXPONENT = 1.1  # synthetic tokens follow a Zipf law, so the loss has something to learn quickly


@dataclass(frozen=True)
class Run:
    variant: str    # "diff" or "softmax" (the equal-size baseline)
    precision: str  # a key of PRECISIONS
    backend: str | None = None  # DIFF's model.attention_backend; None: the config's

    @property
    def name(self) -> str:
        return f"{self.variant}{f'[{self.backend}]' if self.backend else ''}-{self.precision}"


def run_config(args, run: Run) -> Config:
    """The benchmark's DIFF model, or its equal-size softmax twin: twice the heads of half the width."""
    model = SMALL_MODEL if args.config is None else RECIPE_SLICE if args.config.resolve() == RECIPE else []
    overrides = model + [f"train.micro_batch_size={args.micro_batch}",
                         f"train.global_batch_size={args.micro_batch * args.micro_batches}",
                         f"train.lr={args.lr}", f"train.lr_warmup_iters={args.warmup + args.steps}",
                         *PRECISIONS[run.precision], *args.set]
    backend = [f"model.attention_backend={run.backend}"] if run.backend else []
    diff = load_config(args.config, overrides + ["model.variant=diff"] + backend)
    if run.variant == "diff":
        return diff
    m = diff.model
    twin = ["model.variant=softmax", f"model.num_attention_heads={2 * m.num_attention_heads}",
            f"model.head_dim={resolved_head_dim(m)}", "model.lambda_init=depth"]
    if m.num_kv_heads is not None:
        twin.append(f"model.num_kv_heads={2 * m.num_kv_heads}")
    return load_config(args.config, overrides + twin)


def zipf_batches(cfg: Config, count: int, device: torch.device, seed: int) -> list[dict]:
    """`count` micro-batches of tokens drawn from one Zipf distribution over the vocabulary."""
    m, micro = cfg.model, cfg.train.micro_batch_size
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, m.vocab_size + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    ranks_to_tokens = torch.randperm(m.vocab_size, generator=gen)
    batches = []
    for _ in range(count):
        draws = torch.multinomial(weights, micro * (m.seq_length + 1), replacement=True, generator=gen)
        tokens = ranks_to_tokens[draws].view(micro, m.seq_length + 1).to(device)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            position_ids=torch.arange(m.seq_length, device=device).expand(micro, -1),
                            loss_mask=torch.ones(micro, m.seq_length, device=device)))
    return batches


def measure_run(args, run: Run, device: torch.device) -> dict:
    cfg = run_config(args, run)
    initialize(cfg.parallel, args.seed)
    row = dict(asdict(run), run=run.name, params=count_parameters(cfg.model).total,
               tokens_per_step=cfg.train.global_batch_size * cfg.model.seq_length,
               attention_backend=resolve_backend(cfg.model.attention_backend,
                                                 torch.empty(0, device=device)) if run.variant != "softmax" else
               "sdpa", losses=[], lrs=[])
    if run.precision == "fp8" and importlib.util.find_spec("torchao") is None:
        row["status"] = "skipped: torchao is not installed"
        return row
    set_seed(args.seed)  # the same initial weights and data for every precision of a variant
    engine = build_engine(cfg)
    # lr rises linearly over the whole run, as pretraining's warmup does: at a constant 3e-4 from the first
    # step, the loss jumped from 12 to 21-24 and swung for the rest of the run (H200, 2026-11-27), so BF16's
    # and FP8's losses parted by up to 2.2 where the two precisions' numerics differ by far less
    scheduler = build_scheduler(cfg, engine.optimizer)
    steps = args.warmup + args.steps
    pool = zipf_batches(cfg, args.micro_batches * (steps + 1), device, args.seed)  # + 1: the profiled step

    skipped = []  # steps that made no update (non-finite gradients): faster, so not a fair timing

    def step():
        index = len(row["losses"]) * args.micro_batches
        micro = iter(pool[index:index + args.micro_batches])
        scheduler.step(1)  # as pretraining orders it: the first step at lr / steps, the last at lr
        row["lrs"].append(engine.optimizer.param_groups[0]["lr"])  # what this step's update uses
        result = train_step(engine, micro, args.micro_batches)
        if not result.updated:  # the schedule follows the updates
            scheduler.step(-1)
        row["losses"].append(result.loss)
        if not result.updated and len(row["losses"]) > args.warmup:  # the timed steps only
            skipped.append(len(row["losses"]))

    with recording_sdpa_kernels() as kernels:  # torch's choice, or model.sdpa_kernels'
        for _ in range(args.warmup):  # compilation: Triton autotuning, torch.compile of the float8 casts
            step()
    row["sdpa_kernels"] = kernels_ran(kernels)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_ms = timed_ms(step, device, args.steps)
    status = "ok" if all(map(math.isfinite, row["losses"])) else "non-finite loss"
    if status == "ok" and skipped:
        status = f"{len(skipped)} updates skipped (non-finite gradients)"
    row.update(step_ms=step_ms, status=status)
    row["tokens_per_s"] = row["tokens_per_step"] / (step_ms / 1e3)
    flops_per_token = training_flops_per_token(cfg.model, tensor_parallel=cfg.parallel.tensor)
    row["tflops_per_device"] = flops_per_token * row["tokens_per_s"] / 1e12
    if args.peak_tflops:
        row["mfu"] = row["tflops_per_device"] / args.peak_tflops
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    row["first_loss"], row["last_loss"] = row["losses"][0], row["losses"][-1]
    # where a step's time goes, by kernel: one more step, profiled, left out of the curve and the timings
    row["step_kernel_ms"] = kernel_times_ms(step, device, reps=1, top=12)
    del row["losses"][-1], row["lrs"][-1]
    return row


def measure_safely(args, run: Run, device: torch.device) -> dict:
    """One run; a failure is recorded in its row, and the other runs still get measured."""
    try:
        return measure_run(args, run, device)
    except Exception as error:  # noqa: BLE001 -- out of memory, a compiler failure, ...
        status = "out of memory" if isinstance(error, torch.OutOfMemoryError) else \
            f"error: {type(error).__name__}: {' '.join(str(error).split())[:300]}"  # one line: the Markdown table's
        return dict(asdict(run), run=run.name, status=status, losses=[])


def _measure_in_child(args, run: Run, rows) -> None:
    device = torch.device(args.device)
    row = measure_safely(args, run, device)
    row["triton_tiles"] = tiles_tuned_here(device)  # the fused kernel's timings come with its tiles
    rows.send(row)  # before the teardown, which cannot lose the measurement then
    shutdown()


def measure_in_own_process(args, run: Run) -> dict:
    """One run in a fresh process. In one process, the second run found the first one's weights, gradients
    and Adam state still allocated (26 GiB on the 8-layer slice; its peak memory with them): megatron's
    DDP, with overlap_grad_reduce, hooks each parameter's gradient accumulator with a closure that holds
    the parameter, a cycle through autograd's C++ graph that the garbage collector cannot free."""
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_measure_in_child, args=(args, run, sender))
    child.start()
    sender.close()  # the child's end only: recv() then ends (EOFError) if the child dies without a row
    try:
        row = receiver.recv()
    except EOFError:
        row = None
    child.join(CHILD_EXIT_TIMEOUT_S)
    if child.is_alive():  # stuck in its teardown, with its row already sent
        child.kill()
        child.join()
    if row is None:
        row = dict(asdict(run), run=run.name, status=f"error: its process died (exit code {child.exitcode})",
                   losses=[])
    summary = (f"{row['tokens_per_s']:,.0f} tokens/s, loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}"
               if "tokens_per_s" in row else "")
    print(f"  {row['status']}: {summary}", flush=True)
    return row


def add_ratios(rows: list[dict]) -> dict:
    """Tokens/s of each run over its baseline: DIFF over softmax (same precision), FP8 over BF16."""
    ok = {r["run"]: r for r in rows if r["status"] == "ok"}
    ratios = {}
    for row in rows:
        if row["run"] not in ok:
            continue
        softmax = ok.get(f"softmax-{row['precision']}")
        if softmax and row["variant"] != "softmax":
            row["vs_softmax"] = row["tokens_per_s"] / softmax["tokens_per_s"]
            ratios[f"{row['run']} / softmax-{row['precision']} tokens/s"] = row["vs_softmax"]
        bf16 = ok.get(Run(row["variant"], "bf16", row.get("backend")).name)
        if bf16 and row["precision"] != "bf16":
            row["vs_bf16"] = row["tokens_per_s"] / bf16["tokens_per_s"]
            row["loss_gap_vs_bf16"] = max(abs(a - b) for a, b in zip(row["losses"], bf16["losses"]))
            ratios[f"{row['run']} / {bf16['run']} tokens/s"] = row["vs_bf16"]
    return ratios


COLUMNS = (("run", "run", "{}"), ("attention", "attention_backend", "{}"), ("SDPA kernel", "sdpa_kernels", "{}"),
           ("params", "params", "{:,d}"),
           ("tokens/step", "tokens_per_step", "{:,d}"), ("step ms", "step_ms", "{:.1f}"),
           ("tokens/s", "tokens_per_s", "{:,.0f}"), ("TFLOP/s/device", "tflops_per_device", "{:.1f}"),
           ("MFU", "mfu", "{:.1%}"), ("peak GiB", "peak_memory_gib", "{:.1f}"),
           ("x softmax", "vs_softmax", "{:.3f}"), ("x bf16", "vs_bf16", "{:.3f}"),
           ("first loss", "first_loss", "{:.3f}"), ("last loss", "last_loss", "{:.3f}"),
           ("max loss gap vs bf16", "loss_gap_vs_bf16", "{:.3f}"), ("status", "status", "{}"))


def markdown(report: dict) -> str:
    env, setup = report["environment"], report["setup"]
    peak = f"{setup['peak_tflops']:g} TFLOP/s (dense BF16)" if setup["peak_tflops"] else "unknown (no MFU)"
    lines = [f"# Whole-model benchmark, {env['device']}", "",
             f"{env['date']}; {software(env)}. "
             f"Model: {setup['model']}. {setup['micro_batches']} micro-batches of {setup['micro_batch']} per step, "
             f"{setup['warmup']} warm-up steps, then the mean of {setup['steps']} timed steps. MFU peak: {peak}. "
             "TFLOP/s counts matmul FLOPs (megadiff.models.param_count.training_flops_per_token). Targets: "
             "DIFF >= 0.95x the softmax model's tokens/s; FP8 faster than BF16 at a similar loss.", ""]
    lines += markdown_table(COLUMNS, report["rows"])
    if report["ratios"]:
        lines += ["", "## Ratios", ""] + [f"- {name}: **{value:.3f}**" for name, value in report["ratios"].items()]
    lines += ["", "## Where a step's time goes", "", "ms by kernel in one more step, profiled apart from the timings:",
              ""]
    lines += [f"- {r['run']}: " + ", ".join(f"`{name}` {ms:.2f}" for name, ms in r["step_kernel_ms"].items())
              for r in report["rows"] if r.get("step_kernel_ms")]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="a tiny model: checks the script, not the speed")
    parser.add_argument("--config", type=Path, default=RECIPE,
                        help="the DIFF recipe to measure (default: configs/diff-3b.yaml cut to 8 layers)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--variants", nargs="+", default=["softmax", "diff"], choices=("softmax", "diff"))
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=tuple(PRECISIONS))
    parser.add_argument("--diff-backends", nargs="+", default=[None], choices=("triton", "sdpa", "sdpa_split_v"),
                        help="one DIFF run per attention backend (default: one, with the config's backend)")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument("--lr", type=float, default=3e-4, help="the peak lr, reached at the last step after a "
                        "linear warmup over the whole run")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense BF16 peak for MFU (default: known GPUs, e.g. H100 SXM 989)")
    parser.add_argument("--out-dir", type=Path, default=None, help=OUT_DIR_HELP)
    args = parser.parse_args(argv)
    args.out_dir = args.out_dir or default_out_dir(args.small)
    if args.small:
        args.config = None  # the tiny built-in model
    small = args.small or args.device == "cpu"
    defaults = dict(micro_batch=2, micro_batches=1 if small else 4, warmup=1 if small else 3,
                    steps=2 if small else 10)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if cuda_missing(args.device, "bench/model.py"):
        return 0
    device = torch.device(args.device)
    args.peak_tflops = device_peak_tflops(args.peak_tflops) if device.type == "cuda" else args.peak_tflops
    runs = [Run(variant, precision, backend) for precision in args.precisions for variant in args.variants
            for backend in (args.diff_backends if variant == "diff" else [None])]
    diff = run_config(args, Run("diff", args.precisions[0]))
    m = diff.model
    setup = dict(model=f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} DIFF heads "
                       f"(softmax: {2 * m.num_attention_heads}), N={m.seq_length}, vocab {m.vocab_size}",
                 micro_batch=args.micro_batch, micro_batches=args.micro_batches, warmup=args.warmup,
                 steps=args.steps, peak_tflops=args.peak_tflops, overrides=list(args.set),
                 config=str(args.config) if args.config else None)
    report = dict(environment=environment(device), setup=setup, rows=[], ratios={}, triton_tiles={})
    for run in runs:
        print(f"{run.name} ...", flush=True)
        row = measure_in_own_process(args, run)
        for kernel, tiles in row.pop("triton_tiles", {}).items():
            report["triton_tiles"].setdefault(kernel, {}).update(tiles)
        report["rows"].append(row)
        report["ratios"] = add_ratios(report["rows"])
        path = write("model", report, markdown(report), args.out_dir)  # after each run: kept if cut short
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
