"""`megadiff pretrain CONFIG [key=value ...]`: the pre-training loop, in one process or under torchrun.

Rerunning the same command continues from the latest checkpoint in output_dir, reproducing the
uninterrupted run's losses exactly. The run stops cleanly, with a checkpoint, at
`train.iters`, after an iteration divisible by `train.exit_interval`, at the first iteration
boundary after `train.exit_duration_minutes`, or after SIGTERM/SIGUSR1 (exit code 75: requeue me).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megadiff.checkpoint.format import CHECKPOINTS_DIR, CONFIG_FILE, reading_checkpoint
from megadiff.checkpoint.training_checkpoint import CheckpointWriter
from megadiff.config import (
    Config, ConfigError, TrainConfig, data_parallel_size, dump_config, load_config, lr_decay_length,
    micro_batches_per_step, refuse_a_file_for_directory, short_warmup_warning,
)
from megadiff.console import plain_console, timed_step
from megadiff.errors import MegadiffError, refused_together
from megadiff.files import appears, remove_staging_leftovers
from megadiff.models.memory import (
    GIB, activations_warning, check_fits, estimate_activations, model_state_memory,
)
from megadiff.models.sdpa_calls import sdpa_kernels_refusal_for
from megadiff.observability.metrics import MetricsWriter, StepMeans, record_step, records_at, streak_start
from megadiff.observability.profiling import IterationProfiler
from megadiff.observability.wandb_sink import wandb_sink
from megadiff.ops.common import triton_candidates_limit
from megadiff.ops.dispatch import triton_unavailable
from megadiff.parallel import (
    compute_device, init_process_group, initialize, released_after, tensor_parallel_across_nodes,
)
from megadiff.parallel.initialize import local_device
from megadiff.preemption import REQUEUE_EXIT_CODE, PreemptionHandler, signal_name
from megadiff.rank_agreement import check_ranks_agree, claimed_run_directory, comparable
from megadiff.training.batches import IterationBatches, MicroBatchSampler, micro_batch_loader
from megadiff.training.engine import Engine, build_engine
from megadiff.training.spikes import SpikeGuard
from megadiff.training.state import Start, plan_start, prepared_again, restore, training_data_digests
from megadiff.training.step import train_step, validation_sums
from megadiff.training.throughput import Throughput, layer_lambdas
from megadiff.watchdog import STALLS_DIR, StallWatchdog

CONSOLE_KEYS = ("lm_loss", "valid_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
                "max_memory_allocated_gib", "skipped_iterations", "skipped_spikes")


class TrainingError(MegadiffError, RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps)."""


def build_scheduler(cfg: Config, optimizer) -> OptimizerParamScheduler:
    """The papers' schedules in iterations: linear warmup from 0, then linear/cosine decay to min_lr,
    or warmup-stable-decay (the peak lr, then a final decay of train.lr_wsd_decay_iters).

    The config's values win over a checkpoint's, so the schedule's length follows train.iters
    (or train.lr_decay_iters); only the position (iterations done) comes from the checkpoint:
    a WSD run's stable phase can be extended, or a decay branched off one of its checkpoints.
    A run shorter than its warmup (e.g. `train.iters=3` on a recipe) only warms up.
    """
    return _train_scheduler(cfg.train, optimizer)


def _train_scheduler(t: TrainConfig, optimizer) -> OptimizerParamScheduler:
    wsd = dict(lr_decay_style="WSD", wsd_decay_steps=t.lr_wsd_decay_iters, lr_wsd_decay_style=t.lr_wsd_decay_style)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=lr_decay_length(t), start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=t.iters,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
        **(wsd if t.lr_decay_style == "wsd" else dict(lr_decay_style=t.lr_decay_style)))


def _lr_of_update(t: TrainConfig, update: int) -> float:
    """The lr of the `update`-th update (from 1) under t's schedule."""
    optimizer = SimpleNamespace(param_groups=[{}])  # the scheduler only writes each group's lr and decay
    _train_scheduler(t, optimizer).step(update)
    return optimizer.param_groups[0]["lr"]


# the train keys that draw the lr schedule
SCHEDULE_KEYS = ("iters", "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_wsd_decay_iters",
                 "lr_wsd_decay_style")


def lr_schedule_change(t: TrainConfig, start: Start) -> str | None:
    """What a continued run whose lr schedule differs from its checkpoint's does to the lr. The config's schedule
    wins (build_scheduler), recomputed at the checkpoint's position: a finished linear or cosine run lengthened
    goes from min_lr back up the stretched decay, a WSD run resumed in its decay with more iterations back to the
    peak. megatron refuses such a resume by default; megadiff runs it, and says so where the schedules part at the
    checkpoint's last update (a WSD stable phase lengthened, or a decay branched off it, joins on unsaid)."""
    if start.checkpoint_train is None or not (start.saved or {}).get("scheduler"):
        return None
    before, done = start.checkpoint_train, start.saved["scheduler"]["num_steps"]  # updates, not skipped steps
    if done == 0:  # nothing trained yet: no lr to jump from
        return None
    last = _lr_of_update(before, done)
    if math.isclose(last, _lr_of_update(t, done), rel_tol=1e-6, abs_tol=1e-12):
        return None
    changed = "; ".join(f"train.{key}: {getattr(before, key)!r} -> {getattr(t, key)!r}" for key in SCHEDULE_KEYS
                        if getattr(before, key) != getattr(t, key))
    return (f"the lr schedule differs from the checkpoint's ({changed}): the lr goes from {last:.4g}, its update "
            f"{done:,}'s, to {_lr_of_update(t, done + 1):.4g} at the next, where this run's schedule has it. To go on "
            f"with the checkpoint's decay, keep its settings (train.lr_decay_iters={lr_decay_length(before)} keeps "
            "where it ends in a lengthened run)")


def nothing_left_to_train(t: TrainConfig, start: Start) -> str | None:
    """A run rerun at or past its train.iters trains nothing: said, as a lowered train.iters is likely a mistake
    (a requeue of a finished run is not, and is told it is done)."""
    iteration = start.position()[0]
    if not start.continues or iteration < t.iters:
        return None
    if iteration == t.iters:
        return f"train.iters: the run is already at iteration {iteration:,}, its last: nothing is left to train"
    return (f"train.iters={t.iters}: the run's checkpoint is already at iteration {iteration:,}, past it: nothing is "
            f"trained. Give train.iters above {iteration:,} to go on")


class Pretraining:
    def __init__(self, cfg: Config, preemption: PreemptionHandler):
        """`preemption`: installed as the run began, with train.exit_duration_minutes as its budget."""
        self.cfg = cfg
        self.preemption = preemption
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dp = data_parallel_size(cfg.parallel, self.world)
        self.num_microbatches = micro_batches_per_step(cfg, self.world)
        self.output = Path(cfg.output_dir)
        self.model_states = model_state_memory(cfg, self.world)
        device = compute_device()
        activations = estimate_activations(cfg, self.world, device.type)
        memory_warning = None
        if device.type == "cuda":
            device_bytes = torch.cuda.get_device_properties(device).total_memory
            check_fits(self.model_states, device_bytes)
            memory_warning = activations_warning(self.model_states, activations, device_bytes)
        start = refused_together(lambda: plan_start(cfg))  # its refusals come before data and model
        with contextlib.ExitStack() as loading:
            # checkpoint.load of a run still training: kept from that run's keep_last until it is loaded, minutes of
            # data and model later (removed meanwhile, the load failed, calling the checkpoint cut short)
            if start.path is not None and not start.own:
                refused_together(lambda: loading.enter_context(reading_checkpoint(start.path)))
            # a background save the last run never committed (an error stopped it first): its files, taking a
            # checkpoint's space, go now, not at this run's first save, and the start says the run goes back before it
            abandoned = refused_together(
                lambda: remove_staging_leftovers(self.output / CHECKPOINTS_DIR) if self.rank == 0 else [])
            # a node seeing an older checkpoint resumed from it; what the tokenizer reads, wherever its copy is
            check_ranks_agree({}, {"starts from a checkpoint": start.path is not None,
                                   "starts at iteration, samples": list(start.position()),
                                   "tokenizer": start.tokenizer})
            # W&B before data and model: a login or project problem should stop the run before them
            self._wandb = refused_together(
                lambda: wandb_sink(self.output, cfg.logging, cfg.model_dump(mode="json")) if self.rank == 0 else None)
            loading.push(_finished_as_failed_on_error(self._wandb))
            t = cfg.train
            self.train_samples, drawn_for = start.data_samples(cfg)
            self.datasets, self.valid_sets, tokenizer, data_now = _prepare_data(cfg, self.train_samples)
            self.document_eod = tokenizer.eod if cfg.data.document_masking else None
            self.engine: Engine = build_engine(cfg)
            self.scheduler = build_scheduler(cfg, self.engine.optimizer)
            # minutes at scale, before the run's first line
            with (timed_step(_rank_0_console(), f"megadiff pretrain: loading {start.path}")
                  if start.path is not None else contextlib.nullcontext()):
                self.state, how = restore(cfg, start, self.engine, self.scheduler)
        self.state.data_samples = self.train_samples
        changed_data, self.state.data = prepared_again(self.state.data, data_now), data_now
        self.unrecorded = StepMeans(self.state.unrecorded)  # the steps since the last record
        self.spike_guard = (SpikeGuard(t.skip_spike_sigma, t.spike_window, **self.state.spike_history)
                            if t.skip_spike_sigma else None)
        self.checkpoints = CheckpointWriter(self.output / CHECKPOINTS_DIR, cfg, cfg.checkpoint.keep_last,
                                            cfg.checkpoint.async_save, tokenizer)
        self.throughput = Throughput(cfg, self.world)
        self.profiler = IterationProfiler(self.output, self.rank, cfg.logging.profile_iterations,
                                          cfg.logging.profile_ranks, cfg.logging.profile_memory)
        self.metrics = None
        if self.rank == 0:
            self.output.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.output / CONFIG_FILE)
            self.metrics = MetricsWriter(self.output, resume_from_iteration=self.state.iteration,
                                         tensorboard=cfg.logging.tensorboard, total_iterations=cfg.train.iters,
                                         console_keys=CONSOLE_KEYS,
                                         wandb=self._wandb)
            for line in self._start_report(activations, memory_warning, how, start, drawn_for, changed_data,
                                           abandoned):
                self.metrics.print(line)

    def _start_report(self, activations, memory_warning: str | None, how: str, start, drawn_for: int,
                      changed_data: list[str], abandoned: list[str]) -> list[str]:
        """What rank 0 says as the run starts: its layout, memory and start, then what differs from the run it
        continues; `abandoned`: the uncommitted saves of an earlier run removed."""
        cfg, t = self.cfg, self.cfg.train
        memory = f"model states {self.model_states.total / GIB:.2f} GiB"
        if not isinstance(activations, str):
            memory += f" + activations {activations.total / GIB:.2f} GiB"
        lines = [f"megadiff pretrain: {cfg.model.variant} model, {self.world} rank{'s' * (self.world > 1)} "
                 f"(TP {cfg.parallel.tensor}, PP {cfg.parallel.pipeline}, CP {cfg.parallel.context}, "
                 f"DP {self.dp}); {memory} on the most loaded rank; {how}; metrics and checkpoints in {self.output}"]
        if abandoned:
            lines.append(f"removed {', '.join(abandoned)} from {self.output / CHECKPOINTS_DIR}: a save the last run "
                         "began and never committed (it stopped before every rank's files were written), so its "
                         "iterations are trained again")
        lines += [warning for warning in (memory_warning, short_warmup_warning(t), lr_schedule_change(t, start),
                                          nothing_left_to_train(t, start), tensor_parallel_across_nodes(cfg.parallel))
                  if warning]
        if start.position_changes:
            lines.append(f"the model's positions differ from the checkpoint's ({'; '.join(start.position_changes)}): "
                         "its weights are trained on with them")
        if start.data_changes:
            lines.append(f"the data order differs from the checkpoint's ({'; '.join(start.data_changes)}): "
                         f"this run reads on from sample {start.position()[1]:,} of its own order")
        if changed_data:
            lines.append(f"the data differs from what the checkpoint trained on ({', '.join(changed_data)}: prepared "
                         f"again since): this run reads on from sample {start.position()[1]:,} of the new data's order")
        elif start.continues and "data" not in start.saved:
            lines.append("the checkpoint keeps no record of the data it trained on (saved by an earlier megadiff): "
                         "data prepared again since cannot be told from it (its next checkpoint records it)")
        lines += self._training_repeats() + self._validation_repeats()
        if 0 < drawn_for < self.train_samples:
            lines.append(f"train.iters: this run draws its data order for {self.train_samples:,} samples "
                         f"(what train.iters reads, or train.planned_samples), not the {drawn_for:,} its "
                         "checkpoint's was drawn for: sources read more than once follow another order "
                         "from here (some samples again, some never). To lengthen a run in one order, give "
                         "train.planned_samples when it starts")
        return lines

    def _training_repeats(self) -> list[str]:
        """Blended sources asked for more training samples than their train split holds: megatron reads them in
        epochs, each document several times, which changes what their weight means (a small corpus given a
        large share is memorised), and said nothing of it."""
        from megadiff.data.datasets import sources_read_again

        key = "data.blend" if self.cfg.data.blend else "data.prefix"
        return [f"{key}: the train split of {prefix} holds {distinct:,} distinct samples of model.seq_length, and "
                f"this run draws {asked:,} from it (its share of the {self.train_samples:,} training samples): its "
                f"documents are read about {asked / max(distinct, 1):.1f} times each; give it a lower weight or "
                "more data if that is not meant"
                for prefix, asked, distinct in sources_read_again(self.datasets[0])]

    def _validation_repeats(self) -> list[str]:
        """A valid split of fewer samples than an evaluation reads: its loss weighs the documents read twice more
        than the others (not the split's mean, nor `megadiff evaluate`'s, which reads each once), said at the start
        where train.eval_interval evaluates."""
        from megadiff.data.datasets import sources_read_again

        t = self.cfg.train
        if not t.eval_interval:
            return []
        return [f"{metric}: the valid split of {prefix} holds {distinct:,} distinct samples of model.seq_length, "
                f"fewer than the {asked:,} asked of it (train.eval_iters x train.global_batch_size = "
                f"{t.eval_iters * t.global_batch_size:,} in all): some of its documents are read twice, others once, "
                "and weigh unequally in the loss; lower train.eval_iters or give the valid split (data.split) more "
                "documents"
                for metric, dataset in self.valid_sets.items()
                for prefix, asked, distinct in sources_read_again(dataset)]

    def _loader(self, dataset, consumed: int, total: int) -> IterationBatches:
        t = self.cfg.train
        sampler = MicroBatchSampler(total, consumed, t.global_batch_size, t.micro_batch_size,
                                    parallel_state.get_data_parallel_rank(), self.dp)
        loader = micro_batch_loader(dataset, sampler, t.dataloader_workers, self.document_eod, self.num_microbatches)
        return IterationBatches(loader, self.num_microbatches, len(self.engine.model), self.cfg.model.vocab_size)

    def _log(self, record: dict) -> None:
        lambdas = layer_lambdas(self.engine.unwrapped())  # collective over pipeline stages
        if self.metrics is not None:
            if lambdas:
                record["lambda"] = lambdas
            self.metrics.log(record)

    def _save(self) -> None:
        self.state.scheduler = self.scheduler.state_dict()
        self.state.unrecorded = self.unrecorded.state()
        # the window of the steps just before this one: none without the guard (the window a checkpoint of an earlier
        # run with it held, kept, judged the first steps of a later run turning it on again against long-gone ones)
        self.state.spike_history = self.spike_guard.history() if self.spike_guard is not None else {}
        self.engine.gather_updated_params()
        # said before and after: a large model's save takes minutes, in which the log showed nothing
        iteration, started = self.state.iteration, time.perf_counter()
        self._say(f"iteration {iteration}: saving a checkpoint")
        self.checkpoints.save(iteration, self.engine.unwrapped(), self.engine.optimizer,
                              self.state.to_dict(), kept_before=self.state.skipping_since)
        done = "handed to the background writer" if self.cfg.checkpoint.async_save else "saved"
        self._say(f"iteration {iteration}: checkpoint {done} in {time.perf_counter() - started:.1f} s")

    def evaluate(self) -> dict[str, float] | None:
        """{metric: mean loss over the loss tokens of eval_iters batches} for each validation set (valid_loss: the
        blend's); none for a set whose batches hold no loss tokens. None where a stop is agreed before one of its
        batches (a preemption signal, a spent budget): the stop waited for the whole evaluation (eval_iters
        batches, minutes at scale), past the scheduler's grace, and the job was killed without its checkpoint."""
        t = self.cfg.train
        for chunk in self.engine.model:
            chunk.eval()
        results = {}
        try:
            for metric, dataset in self.valid_sets.items():
                with self._loader(dataset, 0, t.eval_iters * t.global_batch_size) as batches:
                    sums = self._validation_sums(batches)
                if sums is None:
                    return None
                loss_sum, tokens = sums.tolist()
                if tokens > 0:
                    results[metric] = loss_sum / tokens
        finally:
            for chunk in self.engine.model:
                chunk.train()
        return results

    def _validation_sums(self, batches: IterationBatches) -> torch.Tensor | None:
        """(loss sum, loss tokens) of eval_iters batches, or None once every rank agrees to stop (checked before
        each batch: every rank stops at the same one)."""
        sums = 0
        for _ in range(self.cfg.train.eval_iters):
            if self.preemption.agreed(compute_device()):
                return None
            sums = sums + validation_sums(self.engine, batches.next_iteration(), self.num_microbatches)
        return sums

    def train(self) -> int:
        cfg, t, state = self.cfg, self.cfg.train, self.state
        batches = self._loader(self.datasets[0], state.consumed_samples, self.train_samples)
        preemption = self.preemption
        saved_at = state.iteration  # a run resumed at its end has nothing new to save
        unrecorded = self.unrecorded
        failed = True  # until the loop ends as planned: an error on its way out fails the W&B run
        watchdog = StallWatchdog(cfg.parallel.timeout_minutes, self.output / STALLS_DIR, self.rank)
        self.throughput.measure_peaks_from_here()  # after the restore
        try:
            while state.iteration < t.iters:
                started = time.perf_counter()
                self.profiler.start(state.iteration + 1)
                self.scheduler.step(1)
                with watchdog:
                    result = train_step(self.engine, batches.next_iteration(), self.num_microbatches,
                                        spike_guard=self.spike_guard)
                lr = self.engine.optimizer.param_groups[0]["lr"]
                if not result.updated:  # as megatron's: the schedule follows the updates (fp16's first skips keep
                    self.scheduler.step(-1)  # the warmup whole)
                state.iteration += 1
                state.consumed_samples += t.global_batch_size
                if result.spike:
                    state.skipped_spikes += 1
                elif result.overflow:
                    state.loss_scale_overflows += 1
                elif not (result.updated or result.no_loss_tokens):
                    state.skipped_iterations += 1
                state.skipping_since = streak_start(state.skipping_since, state.iteration, updated=result.updated,
                                                    skipped=not (result.updated or result.overflow
                                                                 or result.no_loss_tokens))
                elapsed = time.perf_counter() - started
                self.checkpoints.poll()
                recorded = record_step(unrecorded, result.loss, elapsed, result.updated,
                                       records_at(state.iteration, cfg.logging.log_interval, t.iters))
                if recorded is not None:
                    loss, seconds, skipped_loss = recorded
                    record = {"iteration": state.iteration, "lm_loss": loss, "skipped_loss": skipped_loss, "lr": lr,
                              "grad_norm": result.grad_norm, "consumed_samples": state.consumed_samples,
                              "skipped_iterations": state.skipped_iterations,
                              "skipped_spikes": state.skipped_spikes if self.spike_guard else None,
                              "no_loss_tokens": result.no_loss_tokens or None,
                              **self._loss_scale(state),
                              **self.throughput.metrics(seconds)}
                    self._log({k: v for k, v in record.items() if v is not None})
                self._report_profile(self.profiler.stop(state.iteration))
                if result.non_finite_ranks:
                    self._say(f"iteration {state.iteration}: skipped, the loss not finite on "
                              f"{', '.join(result.non_finite_ranks)}")
                if result.no_loss_tokens:
                    self._say(f"iteration {state.iteration}: no loss tokens in the global batch (every target "
                              "masked): not applied")
                if not (result.updated or result.spike or result.overflow or result.no_loss_tokens) and \
                        state.skipped_iterations > t.max_skipped_nan_iters:
                    lambdas = layer_lambdas(self.engine.unwrapped())  # collective: every stage stops at this step
                    raise _too_many_skips(state, t.max_skipped_nan_iters, result, lambdas)
                if t.eval_interval and records_at(state.iteration, t.eval_interval, t.iters):  # and the last
                    valid = self.evaluate()
                    if valid is None:
                        self._say(f"iteration {state.iteration}: its evaluation left unfinished (not logged), to "
                                  "stop now")
                    elif self.metrics is not None:
                        # the samples read by then, which scaling laws by tokens take
                        self.metrics.log({"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                                          **valid})
                interval = cfg.checkpoint.save_interval
                if interval and state.iteration % interval == 0:
                    self._save()
                    saved_at = state.iteration
                stop_early = preemption.agreed(compute_device())
                if stop_early or (t.exit_interval and state.iteration % t.exit_interval == 0):
                    if preemption.signalled:
                        self._say(f"{signal_name(preemption.received)} received: checkpointing at iteration "
                                  f"{state.iteration}, then exiting with code {REQUEUE_EXIT_CODE} (on which the Slurm "
                                  "scripts requeue a preempted job)")
                    elif preemption.out_of_time:
                        self._say(f"train.exit_duration_minutes={t.exit_duration_minutes} spent: checkpointing at "
                                  f"iteration {state.iteration}, then exiting with code 0")
                    break
            self._report_profile(self.profiler.stop(state.iteration, final=True))
            if saved_at != state.iteration:
                self._save()
            self.checkpoints.close()
            exit_code = preemption.exit_after_checkpoint(self.rank)
            failed = False
        except TrainingError:
            self.checkpoints.close()  # every rank stops at this step: a background save still commits
            raise
        finally:
            batches.close()
            watchdog.close()
            self.profiler.close()
            if self.metrics is not None:
                self.metrics.close(failed=failed)
        self._say(f"stopped after iteration {state.iteration}; checkpoint in {self.output / CHECKPOINTS_DIR}")
        return exit_code

    def _loss_scale(self, state) -> dict:
        """fp16: the loss scaler's scale and how many steps it skipped (a few while it finds its scale)."""
        if self.cfg.train.precision != "fp16":
            return {}
        return {"loss_scale": float(self.engine.optimizer.get_loss_scale()),
                "loss_scale_overflows": state.loss_scale_overflows}

    def _report_profile(self, written: list[Path]) -> None:
        if written:  # every profiling rank says so, not only the logging one
            print(f"rank {self.rank}: profile written: {', '.join(str(path) for path in written)}", flush=True)

    def _say(self, message: str) -> None:
        if self.metrics is not None:
            self.metrics.print(message)


def _finished_as_failed_on_error(wandb):
    """An exit callback finishing `wandb` (a W&B sink, or None) as failed where the block ends with an error (data,
    model or checkpoint refused): left open, W&B returned it to the next run of the process (a sweep driver's, a
    notebook's), which logged its curve into it and finished it as a success, its own W&B run left empty."""
    def on_exit(error_type, error, traceback) -> None:
        if error_type is not None and wandb is not None:
            wandb.close(failed=True)
    return on_exit


def _too_many_skips(state, max_skipped: int, result, lambdas: dict[str, float]) -> TrainingError:
    # the gradient norm where the step took one: with a finite loss, it alone says what was not finite
    gradient = "" if result.grad_norm is None else f", gradient norm {result.grad_norm}"
    ranks = f" (not finite on {', '.join(result.non_finite_ranks)})" if result.non_finite_ranks else ""
    return TrainingError(f"iteration {state.iteration}: {state.skipped_iterations} steps skipped for a non-finite loss "
                         f"or gradient (train.max_skipped_nan_iters = {max_skipped}, over the whole run); last loss "
                         f"{result.loss}{ranks}{gradient}{_lambdas_not_finite(lambdas)}. The weights were never "
                         "updated from them: lower train.lr, or resume from the last checkpoint (which carries the "
                         "count: raise train.max_skipped_nan_iters); checkpoint.keep_last keeps the last one saved "
                         f"before iteration {state.skipping_since}, where this streak of skips began, to go back to")


def _lambdas_not_finite(lambdas: dict[str, float]) -> str:
    """The differential layers whose lambda the last forward found not finite: the likeliest cause of a DIFF
    run's NaN steps (its exp(lq . lk) terms overflow fp32 past 88), which the loss alone does not name."""
    layers = [layer for layer, value in lambdas.items() if not math.isfinite(value)]
    if not layers:
        return ""
    return (f"; the lambda of {', '.join(layers)} is not finite (exp(lq . lk) overflows fp32: lambda vectors grown "
            "too large, e.g. by model.lambda_std or train.lr)")


def _prepare_data(cfg: Config, train_samples: int):
    """Rank 0 prepares what is missing (the bundled corpus on a fresh checkout); all ranks build
    (train, valid, test) with `train_samples` training samples, the validation sets ({"valid_loss": the valid split, and with
    train.eval_each_source "valid_loss/<name>": each blended prefix's valid split}; a valid split of None where
    train.eval_interval never evaluates), the tokenizer, and the data's digests, all read while no prepare-data
    writes the data."""
    from megadiff.data.datasets import build_datasets, source_config, source_names
    from megadiff.data.locations import training_blend
    from megadiff.data.prepare import ensure_prepared, not_being_prepared
    from megadiff.data.tokenizers import load_tokenizer

    if dist.get_rank() == 0:
        ensure_prepared(cfg)
    dist.barrier()
    t = cfg.train
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    # a run that never evaluates reads no valid split: none is built, nor refused for holding less than a sample
    num_samples = (train_samples, t.eval_iters * t.global_batch_size if t.eval_interval else 0, 0)
    prefixes, _ = training_blend(cfg.data)
    _wait_until_seen(prefixes)
    # minutes at scale (megatron's sample indexes of a large corpus), before the run's first line
    reading = timed_step(_rank_0_console(), "megadiff pretrain: reading the data (its sample indexes built on a "
                                            "first run)")
    with reading, contextlib.ExitStack() as held:
        # until every rank has opened the files (an atomic replacement leaves them theirs), and their digest is read
        refused_together(lambda: held.enter_context(not_being_prepared(prefixes)) if dist.get_rank() == 0 else None)
        # build_datasets checks the data first (vocabulary, splits, .idx/.bin) and names what is wrong
        datasets = build_datasets(cfg, tokenizer, num_samples, t.seed)
        valid_sets = {"valid_loss": datasets[1]}
        if t.eval_interval and t.eval_each_source and len(prefixes) > 1:
            for prefix, name in zip(prefixes, source_names(prefixes)):
                valid_sets[f"valid_loss/{name}"] = build_datasets(source_config(cfg, prefix), tokenizer,
                                                                  (0, num_samples[1], 0), t.seed)[1]
        digests = training_data_digests(cfg)
        dist.barrier()
    return datasets, valid_sets, tokenizer, digests


def _wait_until_seen(prefixes: list[str]) -> None:
    """Until the prefixes' files are seen here, for a while: rank 0 may just have prepared them (the bundled corpus
    on a first run), and a shared filesystem shows another node's new files a moment late (NFS's attribute caches),
    which then refused the run as not prepared. Files still missing after that are build_datasets' to refuse."""
    from megadiff.data.indexed import bin_path, idx_path

    for prefix in prefixes:
        for path in (bin_path(prefix), idx_path(prefix)):
            appears(path)


def _rank_0_console():
    return plain_console(quiet=dist.get_rank() != 0)


# inputs a node may read from its own copy, at its own path (a tokenizer directory, the checkpoint a run starts
# from): what they hold is compared instead. Data and its cache are read by path on every rank (megatron's
# dataset indices are named after it), so they must be the same.
NODE_LOCAL_KEYS = ("data.tokenizer", "checkpoint.load")


def pretrain(cfg: Config) -> int:
    # from the start to the end: a preemption signal while the run starts (minutes at scale: process
    # groups, data, model, checkpoint) or shuts down asks for a requeue too; the default action killed
    # the rank and failed the job. Signalled before its first step, the run stops after that step.
    preemption = PreemptionHandler(budget_minutes=cfg.train.exit_duration_minutes)
    try:
        with released_after():
            init_process_group(timedelta(minutes=cfg.parallel.timeout_minutes))
            # before the model-parallel groups: ranks of another layout would wait in forming them until the timeout
            check_ranks_agree({"output_dir": cfg.output_dir, "data.cache_dir": cfg.data.cache_dir},
                              {"config": comparable(cfg.model_dump(mode="json"), NODE_LOCAL_KEYS)})
            with claimed_run_directory(cfg.output_dir):
                initialize(cfg.parallel, cfg.train.seed)
                return Pretraining(cfg, preemption).train()
    finally:
        preemption.restore()


def pretrain_from_config(config_path: str, overrides: list[str]) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(config_path, overrides, world_size=world_size)  # bad configs fail before any compute
    try:  # read by the kernel's autotuner at the first step, after the model and data are built
        triton_candidates_limit()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # else the first step fails, after minutes of start-up at scale
    unavailable = triton_unavailable() if cfg.model.attention_backend == "triton" else None
    if unavailable:
        raise ConfigError(f"model.attention_backend: 'triton' cannot run here: {unavailable}; use auto (the kernel "
                          "where it runs, else SDPA) or sdpa")
    if cfg.model.sdpa_kernels is not None:
        device = torch.device("cuda", local_device()) if torch.cuda.is_available() else torch.device("cpu")
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            refusal = sdpa_kernels_refusal_for(cfg, device)
        if refusal:
            raise ConfigError(f"model.sdpa_kernels: none of {cfg.model.sdpa_kernels} takes this model's attention "
                              f"calls here; torch says: {refusal}")
    refuse_a_file_for_directory("output_dir", cfg.output_dir, "a run writes a directory (its metrics and checkpoints)")
    return pretrain(cfg)
