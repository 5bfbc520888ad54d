"""The plan of an adaptation run (its output_dir's adaptation.json): which heads are adapted, their
lambda settings and the trained parameters, measured once and read back by every rerun, which is
refused where it asks for something else, or where model.path no longer holds the model it was made
on (checkpoints hold the trained parameters alone: a rerun reads the frozen ones from model.path)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megadiff.adapt import deepspeed_setup as dss
from megadiff.adapt.apply import has_tied_head, plan_adaptation
from megadiff.adapt.config import DAA_METHODS, resolve_selection
from megadiff.adapt.data import BatchReader
from megadiff.adapt.selection import MEASURED_SELECTIONS
from megadiff.adapt.settings import PLAN_FILE, FinetuneConfig
from megadiff.config import ConfigError
from megadiff.errors import first_line, refused_together
from megadiff.files import write_atomically

# what the DAA methods trained by default before plan files recorded it (Dex's default is unchanged)
EARLIER_TRAINABLE = {method: ["*.self_attn.*"] for method in DAA_METHODS}
# what a plan is made from beside its anneal_steps and lambda_learn_init (which it holds itself): a
# rerun asking for other values would be held to the plan without a word
PLANNED_SETTINGS = ("selection", "heads_fraction", "selected_heads", "calibration_batches", "lambda_init")


def adaptation_plan(cfg: FinetuneConfig, model, reader: BatchReader, stage: int, rank: int) -> dict:
    """The saved plan of this output_dir, or a new one measured on calibration batches."""
    import torch.distributed as dist

    plan_file = Path(cfg.output_dir) / PLAN_FILE
    # Rank 0 decides for all whether the plan is saved: under NCCL its broadcast below returns
    # before the others receive it, so a slower rank could otherwise find the file rank 0 has just
    # written, skip the broadcast and pair its next collective with it.
    saved = [plan_file.is_file()]
    dist.broadcast_object_list(saved, src=0)
    if saved[0]:
        # together: each rank checks the model.path it reads, which may be a node-local copy
        plan = refused_together(lambda: checked_saved_plan(plan_file, cfg))
        if "base_model" not in plan or "data" not in plan:  # a plan from before plans recorded them: reruns
            plan.setdefault("base_model", base_model_fingerprint(cfg.model.path))  # from now on are checked
            plan.setdefault("data", planned_data(cfg))
            if rank == 0:
                write_atomically(plan_file, json.dumps(plan, indent=1).encode())
        return _with_trainable(plan, cfg, model, saved=True)
    selection = cfg.adaptation.resolved_selection
    if selection in MEASURED_SELECTIONS:
        with dss.calibration_parameters(model, stage, selection):
            calibration = reader.calibration_batches(cfg.adaptation.calibration_batches)
            plan = plan_adaptation(model, cfg.adaptation, calibration, reader.document_eos)
    else:  # all heads, or the given ones: nothing to measure, nothing to gather
        plan = plan_adaptation(model, cfg.adaptation)
    shared = [{"settings": _planned_settings(cfg), "base_model": base_model_fingerprint(cfg.model.path),
               "data": planned_data(cfg),
               **_with_trainable(plan, cfg, model, saved=False)}]
    dist.broadcast_object_list(shared, src=0)  # every rank measured the same; rank 0's decides
    if rank == 0:
        write_atomically(plan_file, json.dumps(shared[0], indent=1).encode())
    return shared[0]


def checked_saved_plan(plan_file: Path, cfg: FinetuneConfig) -> dict:
    try:
        plan = json.loads(plan_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{plan_file} is not JSON ({first_line(err)}): written before this version wrote it "
                          "whole, and cut short? Remove it to measure the plan again") from None
    if plan["method"] != cfg.adaptation.method:
        raise ConfigError(f"adaptation.method: {cfg.adaptation.method!r}, but {cfg.output_dir} holds a "
                          f"{plan['method']!r} run; use another output_dir")
    check_planned_settings(plan, cfg)
    check_planned_data(plan, cfg)
    check_base_model(plan, cfg)
    return plan


def planned_data(cfg: FinetuneConfig) -> dict:
    """What the run's sample order is made of: its checkpoints count the samples read in that order."""
    # the files by name and size, as base_model's: a resume from a copy elsewhere (node-local) is the same data
    return {"files": [[Path(name).name, Path(name).stat().st_size] for name in cfg.data.files],
            "seq_length": cfg.data.seq_length, "seed": cfg.data.seed}


def check_planned_data(plan: dict, cfg: FinetuneConfig) -> None:
    """Refuses a rerun whose data would pack or order the samples otherwise: it resumed at the saved count of
    samples read, in an order it never read (a plan from before plans recorded its data passes)."""
    recorded, asked = plan.get("data"), planned_data(cfg)
    for key in recorded or ():
        if asked[key] != recorded[key]:
            raise ConfigError(f"data.{key}: {asked[key]!r}, but {cfg.output_dir} was trained on {recorded[key]!r}: "
                              "a rerun reads on in its data's order (its checkpoints count the samples read); "
                              "use another output_dir")


def _planned_settings(cfg: FinetuneConfig) -> dict:
    return {key: getattr(cfg.adaptation, key) for key in PLANNED_SETTINGS}


def check_planned_settings(plan: dict, cfg: FinetuneConfig) -> None:
    """Refuses a setting given for a rerun (set in its config or overrides) that its saved plan was not
    made with; plans from before plans recorded their settings hold anneal_steps and lambda_learn_init."""
    recorded = {"anneal_steps": plan["anneal_steps"], "lambda_learn_init": plan["lambda_learn_init"],
                **plan.get("settings", {})}
    for key in sorted(cfg.adaptation.model_fields_set & recorded.keys()):
        asked, planned = json.loads(json.dumps(getattr(cfg.adaptation, key))), recorded[key]  # as the file holds it
        if key == "selection":  # unset, it is the method's default: Dex's entropy given by name is no other plan
            asked = cfg.adaptation.resolved_selection
            planned = resolve_selection(plan["method"], planned, recorded.get("selected_heads"))
        if asked != planned:
            raise ConfigError(f"adaptation.{key}: {asked!r}, but {cfg.output_dir} was planned with "
                              f"{planned!r} (its adapted heads and lambdas are fixed by {PLAN_FILE}); "
                              "use another output_dir")


def _with_trainable(plan: dict, cfg: FinetuneConfig, model, saved: bool) -> dict:
    """The plan with the parameters its run trains: a resumed (`saved`) run keeps those its optimizer
    state holds, whatever the defaults now."""
    asked = cfg.adaptation.trainable_patterns(has_tied_head(model))
    if saved and "trainable" not in plan and cfg.adaptation.trainable is None:
        # a plan from before plans recorded it, when the DAA methods trained their attention modules alone
        return {"trainable": EARLIER_TRAINABLE.get(plan["method"], asked), **plan}
    if "trainable" in plan and cfg.adaptation.trainable is not None and plan["trainable"] != asked:
        raise ConfigError(f"adaptation.trainable: {asked}, but {cfg.output_dir} trains {plan['trainable']} "
                          "(its optimizer state holds those); use another output_dir")
    return {"trainable": asked, **plan}


def base_model_fingerprint(path: str) -> dict | None:
    """The digest of a local model directory's config.json and the sizes of its weight files (None for
    a hub name), which a rerun compares: reading them is instant, hashing the weights would not be."""
    directory = Path(path)
    if not directory.is_dir():
        return None
    weights = sorted([*directory.glob("*.safetensors"), *directory.glob("pytorch_model*.bin")])
    config = directory / "config.json"
    return {"config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
            "weight_bytes": {file.name: file.stat().st_size for file in weights}}


def check_base_model(plan: dict, cfg: FinetuneConfig) -> None:
    """Refuses a rerun whose model.path no longer holds the model the plan was made on (a plan from before
    plans recorded it passes, and records the model of its first rerun)."""
    recorded = plan.get("base_model")
    if recorded is not None and base_model_fingerprint(cfg.model.path) != recorded:
        raise ConfigError(f"model.path: {cfg.model.path} is not the model {cfg.output_dir} was adapted from (its "
                          f"config.json or weight files differ from those {PLAN_FILE} recorded). Its checkpoints "
                          "hold the trained parameters alone and read the frozen ones from model.path: point it at "
                          "that model, or use another output_dir")
