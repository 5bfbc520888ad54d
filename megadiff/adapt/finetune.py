"""`megadiff adapt CONFIG [key=value ...]`: Dex/DAA adaptation of a pretrained HF model with
DeepSpeed ZeRO 1/2/3, under torchrun, the deepspeed launcher, Slurm, or as one plain process.

1. the config is checked (settings.validate_finetune) before anything is loaded;
2. the model is loaded (ZeRO-3: partitioned at load via HfDeepSpeedConfig), the data packed;
3. head selection runs on the first calibration batches of the training order, on the unmodified
   model; the plan (heads, lambda_init per layer) is written to <output_dir>/adaptation.json, so a
   resumed run rebuilds exactly the same modules without measuring again;
4. DeepSpeed trains the parameters the freeze policy leaves trainable, logging lm_loss, lr,
   grad_norm, tokens_per_s and each layer's lambda(t) to metrics.jsonl, TensorBoard and the console;
5. checkpoints (DeepSpeed's, under <output_dir>/checkpoints) every checkpoint.save_interval, at
   checkpoint.exit_interval or exit_duration_minutes (then it stops, exit code 0), on SIGTERM/SIGUSR1 (then it stops, exit
   code 75: requeue me) and at the end; rerunning the same command continues from the latest one
   with the same data order;
6. at the end the HF directory (export_dir) is written. <output_dir>/config.yaml is the resolved config.

adaptation.method finetune, the papers' control, runs the same steps without adapters: nothing measured in 3,
no lambda in 4, and the stock architecture exported in 6.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from megadiff.adapt import deepspeed_setup as dss
from megadiff.adapt.apply import adapt_with_plan, adapts, current_lambdas, set_step
from megadiff.adapt.data import IGNORED_LABEL, BatchReader, build_packed_dataset
from megadiff.adapt.documents import model_inputs
from megadiff.adapt.export import save_adapted, save_finetuned
from megadiff.adapt.plan import adaptation_plan, checked_saved_plan
from megadiff.adapt.reshard import universal_form
from megadiff.adapt.resume import (
    LATEST_FILE, damage_named, keep_this_runs_loss_scaling, keep_this_runs_optimizer_settings, resume_point,
)
from megadiff.adapt.schedule import resume_schedule, warmup_cosine
from megadiff.adapt.settings import PLAN_FILE, FinetuneConfig, check_tokenizer_fits, load_finetune_config
from megadiff.config import ConfigError
from megadiff.config.loader import dump_config
from megadiff.data.conversations import chat_template_of
from megadiff.data.tokenizers import HFTokenizer
from megadiff.errors import MegadiffError, lacking_weights, refused_together
from megadiff.files import commit_iteration, iteration_dir, remove_staging_leftovers, staging_dir
from megadiff.observability.wandb_sink import wandb_sink
from megadiff.preemption import PreemptionHandler, signal_name
from megadiff.rank_agreement import check_ranks_agree, claimed_run_directory, comparable, ranks_where
from megadiff.watchdog import STALLS_DIR, StallWatchdog

CHECKPOINT_DIR = "checkpoints"


class NonFiniteSteps(MegadiffError, RuntimeError):
    """Too many steps skipped for a non-finite loss or gradient: the adaptation cannot go on."""


def _load_model(cfg: FinetuneConfig, ds_config: dict):
    from transformers import AutoModelForCausalLM

    hf_ds_config = None
    if dss.zero_stage(ds_config) == 3:
        # must exist (and stay alive) before from_pretrained so the weights are partitioned at load
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)
    kwargs = {"dtype": dss.model_dtype(cfg)}
    if hf_ds_config is None:
        # straight from the (memory-mapped, page-cache shared) safetensors onto this rank's device,
        # rather than a full host copy per rank first: 8 ranks of a 13B model would hold 200 GB
        kwargs["device_map"] = {"": dss.device()}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    model, loading = AutoModelForCausalLM.from_pretrained(cfg.model.path, output_loading_info=True, **kwargs)
    lacking = lacking_weights(cfg.model.path, loading["missing_keys"])
    if lacking:  # adapted, trained and exported, the random weights made a model that was never the pretrained one
        raise ConfigError(f"model.path: {lacking}")
    return model, hf_ds_config


def _rank_0_first(build, rank: int):
    """Global rank 0 builds first, filling the datasets cache; then each other node's local rank 0, which reads that
    cache where it is shared (data.cache_dir or $HOME on a shared filesystem) and fills its node's own otherwise;
    then the others, reading their node's. Every node's leader building at once into a shared cache tokenized the
    data once a node, each renaming its finished file over the one another node's ranks had memory-mapped (a stale
    handle, SIGBUS, on NFS), and flock, which datasets' cache locks use, is no lock across nodes. A build failing
    on any rank (the data's checks) stops every rank, rather than leaving the others waiting for it."""
    turn = 0 if rank == 0 else 1 if int(os.environ.get("LOCAL_RANK", "0")) == 0 else 2
    built = [refused_together(build if turn == step else _nothing) for step in range(3)]
    return built[turn]


def _nothing() -> None:
    return None


def _sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value


class Iteration(NamedTuple):
    loss: float | None           # the mean over the global batch's targets; None: it has none (not trained on)
    lr: float                    # the lr it used
    non_finite_ranks: list[str]  # with a non-finite loss: "rank R (host)" of each rank whose own loss was not finite


def _train_iteration(engine, reader: BatchReader, iteration: int, grad_accum: int) -> Iteration:
    """One optimizer step (grad_accum micro-steps); none where the global batch holds no targets (chat data whose
    assistant turns were all cut): its loss is no 0, and Adam's moments would move the weights on no gradient."""
    import torch.distributed as dist

    lr = engine.get_lr()[0]
    batches = [[t.to(engine.device) for t in reader.micro_batch_at(iteration - 1, micro_step)]
               for micro_step in range(grad_accum)]
    # every target of the global batch weighs the same, however it is split into micro-batches and ranks (with a
    # loss mask they hold unequal targets): DeepSpeed averages the micro-steps' and ranks' gradients, so each
    # micro-batch's summed loss is divided by the targets a micro-batch holds on average
    targets = _sum_over_ranks(sum((labels[:, 1:] != IGNORED_LABEL).sum() for _, labels in batches))
    if targets == 0:  # the same on every rank
        return Iteration(None, lr, [])
    per_micro_batch = targets / (grad_accum * dist.get_world_size())
    losses = []
    for input_ids, labels in batches:
        loss = engine(**model_inputs(input_ids, reader.document_eos), labels=labels,
                      num_items_in_batch=per_micro_batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    own_losses = torch.stack(losses)
    loss = _sum_over_ranks(own_losses.sum()).item() / (grad_accum * dist.get_world_size())
    # collective: taken only where the sum is not finite, which every rank knows
    return Iteration(loss, lr, [] if math.isfinite(loss) else ranks_where(not bool(own_losses.isfinite().all())))


def _export(cfg: FinetuneConfig, engine, tokenizer, plan: dict, stage: int, rank: int) -> None:
    import torch.distributed as dist

    state_dict = engine._consolidated_16bit_state_dict() if stage == 3 else None
    if rank == 0 and adapts(plan):
        path = save_adapted(engine.module, cfg.resolved_export_dir, state_dict=state_dict, tokenizer=tokenizer)
        print(f"saved the adapted model to {path} (load with trust_remote_code=True)", flush=True)
    elif rank == 0:
        path = save_finetuned(engine.module, cfg.resolved_export_dir, state_dict=state_dict, tokenizer=tokenizer)
        print(f"saved the fine-tuned model to {path} ({type(engine.module).__name__}, no remote code)", flush=True)
    dist.barrier()


def _prepare(cfg: FinetuneConfig, ds_config: dict, rank: int, world: int):
    """Tokenizer, adapted model (plan measured or reloaded) and batch reader."""
    from transformers import AutoTokenizer

    stage = dss.zero_stage(ds_config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    check_tokenizer_fits(tokenizer, cfg)
    if cfg.data.chat_template is not None:  # the export is chatted with as it was tuned
        tokenizer.chat_template = chat_template_of(cfg.data, HFTokenizer("model.tokenizer", tokenizer))
    # the data first: its refusals (template, fields, too few tokens) come before minutes of loading weights
    dataset = _rank_0_first(lambda: build_packed_dataset(cfg.data, tokenizer), rank)
    model, hf_ds_config = _load_model(cfg, ds_config)
    reader = BatchReader(dataset, cfg.data.seed, cfg.train.micro_batch_size, cfg.train.grad_accum, rank, world,
                         document_eos=tokenizer.eos_token_id if cfg.data.document_masking else None)
    plan = adaptation_plan(cfg, model, reader, stage, rank)
    adapt_with_plan(model, plan, plan["trainable"])
    if cfg.train.gradient_checkpointing:
        # non-reentrant: the frozen embeddings' output, each layer's input, needs no gradient
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return tokenizer, model, reader, plan, hf_ds_config


# inputs a node may read from its own copy, at its own path (the base model's plan and data checks compare what
# they hold); the DeepSpeed JSON's path is kept relative where it is found, so its contents are compared
NODE_LOCAL_KEYS = ("model.path", "model.tokenizer", "data.files", "data.cache_dir", "deepspeed")


def _latest_tag(checkpoint_dir: Path) -> str | None:
    """The checkpoint a rerun resumes from, as this rank sees it."""
    try:
        latest = checkpoint_dir / LATEST_FILE
        return latest.read_text().strip() if latest.is_file() else None
    except OSError as err:  # refused by the ranks' check, not on this rank alone (the others would wait for it)
        return f"unreadable: {err}"


def finetune(cfg: FinetuneConfig) -> int:
    """Run (or continue) the adaptation. Returns the process exit code: 0 when finished or stopped at
    checkpoint.exit_interval / exit_duration_minutes, REQUEUE_EXIT_CODE when stopped by SIGTERM/SIGUSR1."""
    ds_config = dss.deepspeed_config(cfg, dss.launcher_world_size())  # its errors come before any compute
    # before the minutes of start-up (model, head selection, DeepSpeed, checkpoint): a preemption signal
    # during them asks for a requeue too (the default action killed the rank); the run then stops after
    # its first iteration, with a checkpoint
    stop = PreemptionHandler(budget_minutes=cfg.checkpoint.exit_duration_minutes)
    # a caller's process goes on after the run (a notebook, a sweep driver): left installed, the handlers kept
    # SIGTERM from ending it, the world of one's variables failed its next process group (RANK without
    # MASTER_PORT) and reached every process it started, and ZeRO-3 stayed on for its later from_pretrained
    try:
        with dss.rendezvous_variables_restored(), dss.transformers_zero3_setting_restored():
            return _finetune(cfg, ds_config, stop)
    finally:
        stop.restore()


def _finetune(cfg: FinetuneConfig, ds_config: dict, stop: PreemptionHandler) -> int:
    """finetune's run, `stop` installed."""
    import deepspeed

    from megadiff.observability.metrics import MetricsWriter, StepMeans, record_step, records_at, streak_start

    rank, world = dss.init_distributed(cfg.train.timeout_minutes)
    # DeepSpeed's ZeRO collectives call an API torch deprecates, once per call: keep the console readable
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated")
    stage = dss.zero_stage(ds_config)
    output_dir = Path(cfg.output_dir)
    # made by rank 0 (in a world of one too): a node where it cannot be made is named by the check below
    refused_together(lambda: output_dir.mkdir(parents=True, exist_ok=True) if rank == 0 else None)
    check_ranks_agree({"output_dir": output_dir}, {"config": comparable(cfg.model_dump(mode="json"), NODE_LOCAL_KEYS),
                                                   "deepspeed": ds_config,
                                                   "resumes from": _latest_tag(output_dir / CHECKPOINT_DIR)})
    with claimed_run_directory(output_dir):  # before the run writes anything there
        resumed = refused_together(lambda: resume_point(output_dir / CHECKPOINT_DIR, rank, world, ds_config))
        # before the model loads: converted once, for this and any later rerun on another number of ranks
        universal = universal_form(resumed, rank, world) if resumed is not None else None

        def started_on_rank_0():
            # as pre-training's: it can be passed back as a config, its relative paths read from where the run ran
            dump_config(cfg, output_dir / "config.yaml")
            # before the model loads: a W&B login or project problem stops the run at once, on every rank
            return wandb_sink(output_dir, cfg.logging, cfg.model_dump(mode="json"))

        wandb = refused_together(lambda: started_on_rank_0() if rank == 0 else None)
        writer = None
        watchdog = StallWatchdog(cfg.train.timeout_minutes, output_dir / STALLS_DIR, rank)
        failed = True  # until the run ends as planned: an error on its way out (from here on) fails the W&B run
        try:
            torch.manual_seed(cfg.train.seed)
            tokenizer, model, reader, plan, _hf_ds_config = _prepare(cfg, ds_config, rank, world)

            engine, *_ = deepspeed.initialize(model=model, config=dss.loading_universal(ds_config) if universal else
                                              ds_config, lr_scheduler=warmup_cosine(cfg.train),
                                              model_parameters=dss.parameter_groups(model))
            leave_out_frozen_aliases(engine)
            # from_pretrained leaves the model in eval mode (and head selection measured it so): training mode
            # turns on its dropout and gradient checkpointing
            engine.train()
            checkpoint_dir = output_dir / CHECKPOINT_DIR
            start, unrecorded = 0, StepMeans()  # the loss and seconds of the steps since the last record
            skipped = 0  # the steps whose update DeepSpeed left out for a non-finite gradient norm
            overflows = 0  # fp16: the steps its loss scaler left out (each lowering the scale)
            # the first iteration of the streak of such steps the run is in: keep_last keeps the checkpoint before it
            skipping_since = None
            schedule_change = None  # what a rerun's other lr schedule does to the lr, said as it starts
            if resumed is not None:
                # not strict: checkpoints hold the trained parameters only, the frozen ones are the base model's
                load_dir, tag = (resumed, universal.name) if universal else (checkpoint_dir, resumed.name)
                configured_scaler = getattr(engine.optimizer, "loss_scaler", None)  # the load replaces it
                with damage_named(resumed):
                    _, client_state = engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=False)
                start = client_state["iteration"]
                # absent from checkpoints of earlier versions, whose reruns read with the checkpoint's global batch
                reader.resume_at(start, client_state.get("samples_read", start * reader.global_batch))
                unrecorded = StepMeans(client_state.get("unrecorded"))  # absent from checkpoints of earlier versions
                skipped = client_state.get("skipped_iterations", 0)  # likewise
                overflows = client_state.get("loss_scale_overflows", 0)  # likewise
                skipping_since = client_state.get("skipping_since")  # likewise
                schedule_change = resume_schedule(engine.lr_scheduler, cfg.train)
                keep_this_runs_optimizer_settings(engine.optimizer, cfg.train)
                keep_this_runs_loss_scaling(engine.optimizer, configured_scaler)
            if rank == 0:
                writer = MetricsWriter(output_dir, resume_from_iteration=start, tensorboard=cfg.logging.tensorboard,
                                       total_iterations=cfg.train.iters,
                                       console_keys=("lm_loss", "lr", "grad_norm", "tokens_per_s", "loss_scale",
                                                     "loss_scale_overflows"),
                                       wandb=wandb)
                writer.print(f"adapt: {plan['method']} on {cfg.model.path}, ZeRO-{stage}, {world} rank(s), "
                             f"{len(reader.dataset)} sequences of {cfg.data.seq_length} tokens, "
                             + (f"resuming after iteration {start}" if start else "starting"))
                if schedule_change:
                    writer.print(schedule_change)
            tokens_per_iteration = cfg.train.micro_batch_size * cfg.train.grad_accum * world * cfg.data.seq_length
            iteration, exit_code = start, 0
            while iteration < cfg.train.iters:
                iteration += 1
                _anneal(engine, plan)  # lambda(0) = 0 on the first
                torch.manual_seed(iteration_seed(cfg.train.seed, iteration, rank))
                began = time.perf_counter()
                with watchdog:
                    loss, lr, non_finite_ranks = _train_iteration(engine, reader, iteration, cfg.train.grad_accum)
                stepped = loss is not None  # DeepSpeed's step flags are otherwise the last step's
                non_finite_step = stepped and _skipped_for_non_finite(engine, cfg.train.precision)
                skipped += non_finite_step
                applied = stepped and engine.was_step_applied()
                overflows += stepped and not (applied or non_finite_step)
                skipping_since = streak_start(skipping_since, iteration, skipped=non_finite_step, updated=applied)
                # on every rank (the loss is the global batch's): each saves the means with its checkpoint
                recorded = record_step(unrecorded, loss, time.perf_counter() - began, applied,
                                       records_at(iteration, cfg.logging.log_interval, cfg.train.iters))
                if recorded is not None and writer is not None:
                    mean_loss, seconds, skipped_loss = recorded
                    record = {"iteration": iteration, "lm_loss": mean_loss, "skipped_loss": skipped_loss, "lr": lr,
                              "grad_norm": _grad_norm(engine) if stepped else None, "skipped_iterations": skipped,
                              "no_loss_tokens": not stepped or None,
                              **_loss_scale(engine, cfg.train.precision, overflows),
                              "tokens_per_s": tokens_per_iteration / seconds,
                              "lambda": current_lambdas(engine.module) or None}  # None: the control has none
                    writer.log({key: value for key, value in record.items() if value is not None})
                if writer is not None and not stepped:
                    writer.print(f"iteration {iteration}: no loss tokens in the global batch (every target masked): "
                                 "not trained on")
                if writer is not None and non_finite_ranks:
                    writer.print(f"iteration {iteration}: the loss not finite on {', '.join(non_finite_ranks)}")
                # before any save, on every rank alike (the loss and the gradient norm are the global batch's): a
                # run whose every step was NaN went on to its end and exported the untrained model with exit code 0
                if non_finite_step and skipped > cfg.train.max_skipped_nan_iters:
                    raise _too_many_skips(engine, iteration, skipped, cfg.train.max_skipped_nan_iters, loss,
                                          non_finite_ranks)
                exit_now = stop.agreed(engine.device) or (cfg.checkpoint.exit_interval is not None
                                                          and iteration % cfg.checkpoint.exit_interval == 0)
                if exit_now or iteration % cfg.checkpoint.save_interval == 0 or iteration == cfg.train.iters:
                    _save(engine, checkpoint_dir, iteration, rank, cfg.checkpoint.keep_last,
                          {"iteration": iteration, "unrecorded": unrecorded.state(), "skipped_iterations": skipped,
                           "loss_scale_overflows": overflows, "skipping_since": skipping_since,
                           "samples_read": reader.samples_read(iteration)})
                if exit_now and iteration < cfg.train.iters:
                    exit_code = stop.exit_after_checkpoint(rank)
                    if writer is not None:
                        reason = (signal_name(stop.received) if stop.signalled else "checkpoint.exit_duration_minutes"
                                  if stop.out_of_time else "checkpoint.exit_interval")
                        writer.print(f"stopped after iteration {iteration} ({reason}) with a checkpoint; rerun the "
                                     "same command to resume" + (f" (exit code {exit_code})" if stop.signalled else ""))
                    break
            else:
                _anneal(engine, plan)
                _export(cfg, engine, tokenizer, plan, stage, rank)
            failed = False
        finally:  # an error leaves no empty stalls file, and the metrics closed
            watchdog.close()
            if writer is not None:
                writer.close(failed=failed)
            elif wandb is not None:  # failed before the metrics writer took the W&B run over
                wandb.close(failed=failed)
        return exit_code


def _anneal(engine, plan: dict) -> None:
    """The adapted layers' lambda(t) at t = the updates applied so far (the control has no lambda)."""
    if adapts(plan):
        set_step(engine.module, _updates_applied(engine))


def _updates_applied(engine) -> int:
    """lambda(t)'s t: the optimizer updates applied so far, the steps the learning rate's schedule has taken
    (DeepSpeed steps it on applied updates only; its checkpoints keep it). The papers' t is the training
    step: a step DeepSpeed skipped (a non-finite gradient, fp16's overflow) trained nothing, and counted, it
    moved lambda on while the warmup waited."""
    return engine.lr_scheduler.last_epoch


def _skipped_for_non_finite(engine, precision: str) -> bool:
    """Whether DeepSpeed left this step's update out: it does so, silently and in every precision, when the
    global gradient norm is not finite (as a NaN or inf loss makes it), and returns as if it had stepped.
    fp16's skips are its dynamic loss scaler's, which lowers the scale, and stops the run itself at its lowest.
    A static one (the JSON's fp16.loss_scale) lowers and stops nothing: a run whose every step overflowed went on
    to its end and exported its untrained model with exit code 0, so its skips are counted and bounded as these."""
    skips_unbounded = precision != "fp16" or not engine.dynamic_loss_scale()
    return skips_unbounded and not engine.was_step_applied()


def _loss_scale(engine, precision: str, overflows: int) -> dict:
    """fp16: the loss scaler's scale and the steps it left out so far (as pre-training logs them); a step it
    skipped was logged like one that trained."""
    if precision != "fp16":
        return {}
    return {"loss_scale": float(engine.optimizer.loss_scale), "loss_scale_overflows": overflows}


def _grad_norm(engine) -> float:
    grad_norm = engine.get_global_grad_norm()
    return float(grad_norm) if grad_norm is not None else float("nan")


def _too_many_skips(engine, iteration: int, skipped: int, max_skipped: int, loss: float,
                    non_finite_ranks: list[str]) -> NonFiniteSteps:
    ranks = f" (not finite on {', '.join(non_finite_ranks)})" if non_finite_ranks else ""
    # a static fp16 loss scale overflows the gradients at any lr: the scale is what to lower
    cure = "lower fp16.loss_scale in the DeepSpeed JSON (0: a dynamic one)" if engine.fp16_enabled() \
        and not engine.dynamic_loss_scale() else "lower train.lr"
    return NonFiniteSteps(f"iteration {iteration}: {skipped} steps skipped for a non-finite loss or gradient "
                          f"(train.max_skipped_nan_iters = {max_skipped}, over the whole run); loss {loss}{ranks}, "
                          f"gradient norm {_grad_norm(engine)}. The weights were never updated from them: {cure}, "
                          "or resume from the last checkpoint (which carries the count: raise "
                          "train.max_skipped_nan_iters)")


def iteration_seed(seed: int, iteration: int, rank: int) -> int:
    """torch's seed for a rank's iteration: a function of the three, so a resumed run draws the uninterrupted
    run's dropout masks, and each data-parallel rank draws its own (seeded with seed + iteration alone, every
    rank drew the same masks, on its own samples)."""
    return int(np.random.SeedSequence([seed, iteration, rank]).generate_state(1)[0])


def leave_out_frozen_aliases(engine) -> None:
    """DeepSpeed leaves frozen parameters out of a checkpoint by their first names only: a tied head's
    second name (lm_head.weight) kept the frozen embedding in every ZeRO-1/2 checkpoint (525 MB for
    Llama-3.2-1B in bf16). Its module_state_dict, which save_checkpoint calls, now drops every name."""
    frozen = {name for name, param in engine.module.named_parameters(remove_duplicate=False)
              if not param.requires_grad}
    full_state_dict = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        state = full_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name in frozen & state.keys():
                del state[name]
        return state
    engine.module_state_dict = module_state_dict


def _save(engine, checkpoint_dir: Path, iteration: int, rank: int, keep_last: int | None,
          client_state: dict) -> None:
    """DeepSpeed's checkpoint, written under a staging name, renamed and committed by its `latest` file once
    every rank has written its part, then the checkpoints beyond `keep_last` removed (not the last one before
    client_state's streak of skipped steps: those saved during it hold its weights again). DeepSpeed's rank 0
    writes `latest` before the ranks' closing barrier: killed while another rank still wrote (a preemption's
    grace period running out), a run left `latest` naming a checkpoint that no requeue could load, and a
    checkpoint's name on a directory that keep_last counted."""
    import torch.distributed as dist

    final = iteration_dir(checkpoint_dir, iteration)
    if rank == 0:
        remove_staging_leftovers(checkpoint_dir)
    dist.barrier()
    # the frozen parameters (most of the model: 16 GB of an 8B model in bf16) are model.path's
    engine.save_checkpoint(str(checkpoint_dir), tag=staging_dir(final).name, client_state=client_state,
                           save_latest=False, exclude_frozen_parameters=True)
    if rank == 0:  # save_checkpoint ends with that barrier: every rank's files are written
        commit_iteration(checkpoint_dir, iteration, LATEST_FILE, final.name, keep_last,
                         client_state["skipping_since"])


def finetune_from_config(config_path: str, overrides: list[str]) -> int:
    """CLI entry: config errors surface before any process group or model exists. After a run the
    process group is destroyed and the process ends with os._exit, which avoids a rare SIGABRT of
    ZeRO-3 processes at interpreter exit."""
    cfg = load_finetune_config(config_path, overrides)
    # a rerun asking for another plan is refused before it tokenizes, loads weights, or records its config
    saved_plan = Path(cfg.output_dir) / PLAN_FILE
    if saved_plan.is_file():
        checked_saved_plan(saved_plan, cfg)
    exit_code = finetune(cfg)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
