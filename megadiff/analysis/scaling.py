"""`megadiff scaling`: the DIFF paper's scaling comparison (its Figure 3) from finished runs.

By model size (Figure 3a): each run's last validation loss against its parameter count, counted as
the paper counts its sizes (the layers plus one vocabulary matrix). By training tokens (Figure 3b):
every validation loss a run logged against the tokens it had trained on by then. Each variant's
points are fitted with Kaplan et al.'s power law L(X) = (X_c / X)^alpha, a line in log-log (the
law the paper says fits its runs), and every point of the other variants is matched to the
baseline's curve: the baseline size (or tokens) that reaches the same loss, and the share
("6.8B DIFF matches an 11B Transformer: 62.2% of the parameters"). A variant with a curve of
its own is matched at its fitted losses, as the paper reads its figure; `--at` asks for sizes that
no run has (its "7.8B DIFF matches the 13.1B Transformer"). Ablation runs (a DIFF without its head
norm, another lambda_init) draw curves of their own, named after the settings they change.
"""
from __future__ import annotations

import math
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

from megadiff.checkpoint.format import CONFIG_FILE, checkpoint_config
from megadiff.config import ConfigError
from megadiff.config.schema import DIFFERENTIAL_VARIANTS, ModelConfig
from megadiff.config.validate import resolved_head_norm
from megadiff.console import plain_console
from megadiff.inference.reporting import write_report
from megadiff.models.param_count import count_parameters
from megadiff.observability.metrics import METRICS_FILE, read_metrics

AXES = ("params", "tokens")
SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'6.8B', '160b', '7.8e9', '500M' -> the number."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not match:
        raise ConfigError(f"{text!r} is not a count (e.g. 6.8B, 160B, 7.8e9)")
    return float(match.group(1)) * SUFFIXES[match.group(2)]


def format_count(x: float) -> str:
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{suffix}"
    return f"{x:.3g}"


@dataclass(frozen=True)
class PowerLaw:
    """L(X) = (scale / X)^alpha."""
    alpha: float
    scale: float

    def loss(self, x: float) -> float:
        return (self.scale / x) ** self.alpha

    def reaching(self, loss: float) -> float:
        """The X at which the curve's loss is `loss`."""
        return self.scale * loss ** (-1.0 / self.alpha)


def fit_power_law(xs: Sequence[float], losses: Sequence[float]) -> PowerLaw:
    """Least squares in log-log: log L = alpha log X_c - alpha log X."""
    if len(set(xs)) < 2:
        raise ConfigError("a power law needs points at two sizes (token counts) at least")
    slope, intercept = np.polyfit(np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(losses, dtype=float)), 1)
    if slope >= 0:
        raise ConfigError("the losses do not fall as X grows: no power law fits them")
    alpha = -float(slope)
    log_scale = float(intercept) / alpha
    # a nearly flat curve puts its scale beyond any float: above it (losses over 1), or at 0 (below)
    if not math.log(sys.float_info.min) < log_scale < math.log(sys.float_info.max):
        raise ConfigError(f"the losses fall too little as X grows (exponent {alpha:.2g}) for a power law to place "
                          "them: compare runs of sizes or token counts further apart, or trained longer")
    return PowerLaw(alpha, math.exp(log_scale))


# settings that make a run an ablation of its variant (the papers' Table 6, lambda_init sweeps) rather than one
# of its sizes: such runs draw their own curve, named after what they change, instead of joining the variant's
ABLATION_DEFAULTS = {"lambda_init": "depth", "lambda_std": 0.1, "lowrank_zero_init": True}


def run_arm(model: ModelConfig) -> str:
    """The curve a run belongs to: its variant, plus each ablation setting it changes ('diff(head_norm=false)')."""
    changed = {}
    if resolved_head_norm(model) != (model.variant in DIFFERENTIAL_VARIANTS):
        changed["head_norm"] = resolved_head_norm(model)
    if model.variant in DIFFERENTIAL_VARIANTS:  # the softmax baseline has no lambda to ablate
        changed.update({key: getattr(model, key) for key, default in ABLATION_DEFAULTS.items()
                        if getattr(model, key) != default and (key != "lowrank_zero_init" or model.lowrank_rank)})
    if not changed:
        return model.variant
    settings = ",".join(f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                        for key, value in changed.items())
    return f"{model.variant}({settings})"


@dataclass(frozen=True)
class Point:
    run: str
    variant: str      # the curve it joins: the variant, or an ablation of it (run_arm)
    x: float          # parameters, or tokens trained on
    iteration: int
    loss: float


def run_points(path: str | Path, by: str, metric: str = "valid_loss") -> list[Point]:
    """One run's points: its last `metric` (by params, of a finished run) or every one it logged (by tokens)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / METRICS_FILE).is_file():
        raise ConfigError(f"{path} is not a run's output_dir (it needs {CONFIG_FILE} and {METRICS_FILE})")
    cfg = checkpoint_config(path)
    records = read_metrics(path)
    logged = [(r["iteration"], float(r[metric])) for r in records if metric in r]
    if not logged:
        raise ConfigError(f"{path} logged no {metric}: runs log it every train.eval_interval iterations")
    bad = [iteration for iteration, loss in logged if not math.isfinite(loss) or loss <= 0]
    if bad:
        raise ConfigError(f"{path}: {metric} is not a positive number at iteration {bad[0]}: no power law takes it")
    if by == "params":
        trained = max((r["iteration"] for r in records if "lm_loss" in r), default=0)
        if trained < cfg.train.iters:  # its last loss is of a model on the way, at a learning rate not yet decayed
            raise ConfigError(f"{path} stopped at iteration {trained} of its {cfg.train.iters} (train.iters): by "
                              "size a run counts once trained; resume it to its end, or compare it --by tokens")
        count = count_parameters(cfg.model)
        iteration, loss = logged[-1]
        if iteration < trained:  # a run from before runs evaluated after their last iteration
            warnings.warn(f"{path}: its last {metric} is at iteration {iteration} of {trained}, and enters the fit "
                          "for the trained model", stacklevel=2)
        return [Point(str(path), run_arm(cfg.model), float(count.non_embedding + count.embedding), iteration, loss)]
    # the samples the run had read by then: a resumed run may have changed its global batch size
    consumed = {r["iteration"]: r["consumed_samples"] for r in records if "consumed_samples" in r}
    return [Point(str(path), run_arm(cfg.model),
                  float(consumed.get(iteration, iteration * cfg.train.global_batch_size) * cfg.model.seq_length),
                  iteration, loss)
            for iteration, loss in logged]


@dataclass(frozen=True)
class Match:
    """A point (or a requested X) of a variant, on the baseline's curve."""
    variant: str
    x: float
    loss: float               # the variant's curve at x when it has one, else the point's measured loss
    baseline_x: float         # where the baseline's curve reaches that loss
    share: float              # x / baseline_x
    extrapolated: bool        # baseline_x lies outside the baseline runs' range
    run: str | None = None
    iteration: int | None = None
    measured_loss: float | None = None


def scaling_report(points: Sequence[Point], by: str, baseline: str, at: Sequence[float] = (),
                   start: float = 0.0) -> dict:
    """Fits per variant (over points at X >= start) and the matches to the baseline's curve."""
    kept = [p for p in points if p.x >= start]
    variants = sorted({p.variant for p in kept}, key=lambda v: (v != baseline, v))
    if baseline not in variants:
        raise ConfigError(f"no point of the baseline variant {baseline} (the runs are {', '.join(variants) or 'none'}"
                          f"{f' from {format_count(start)} on' if start else ''}); --baseline names another")
    fits: dict[str, PowerLaw] = {}
    for variant in variants:
        mine = [p for p in kept if p.variant == variant]
        if len({p.x for p in mine}) >= 2:
            fits[variant] = fit_power_law([p.x for p in mine], [p.loss for p in mine])
        elif variant == baseline:
            what = "sizes" if by == "params" else "token counts"
            raise ConfigError(f"the baseline ({baseline}) needs points at two {what} at least to draw its curve")
    report = {"by": by, "baseline": baseline, "from": start, "fits": {}, "matches": []}
    for variant, law in fits.items():
        xs = [p.x for p in kept if p.variant == variant]
        report["fits"][variant] = {"alpha": law.alpha, "scale": law.scale, "points": len(xs),
                                   "range": [min(xs), max(xs)]}
    base = fits[baseline]
    low, high = report["fits"][baseline]["range"]

    def match(variant: str, x: float, loss: float, **measured) -> Match:
        baseline_x = base.reaching(loss)
        return Match(variant, x, loss, baseline_x, x / baseline_x, not low <= baseline_x <= high, **measured)

    for p in sorted(kept, key=lambda p: (p.variant, p.x)):
        if p.variant != baseline:
            loss = fits[p.variant].loss(p.x) if p.variant in fits else p.loss
            report["matches"].append(match(p.variant, p.x, loss, run=p.run, iteration=p.iteration,
                                           measured_loss=p.loss))
    for x in at:
        report["matches"].extend(match(v, x, fits[v].loss(x)) for v in fits if v != baseline)
    report["matches"] = [asdict(m) for m in report["matches"]]
    return report


def _print(console: Console, report: dict, metric: str) -> None:
    unit = "parameters" if report["by"] == "params" else "tokens"
    for variant, fit in report["fits"].items():
        console.print(f"{variant}: {metric} = ({format_count(fit['scale'])} / {unit})^{fit['alpha']:.4f}, "
                      f"{fit['points']} points from {format_count(fit['range'][0])} to {format_count(fit['range'][1])}")
    if not report["matches"]:
        console.print(f"no other variant to match to the {report['baseline']} curve")
        return
    table = Table(title=f"on the {report['baseline']} curve, by {unit}")
    for column in ("variant", unit, "iteration", metric, "fitted", f"{report['baseline']} {unit}", "share"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for m in report["matches"]:
        baseline_x = format_count(m["baseline_x"]) + ("*" if m["extrapolated"] else "")
        measured = "" if m["measured_loss"] is None else f"{m['measured_loss']:.4f}"
        table.add_row(m["variant"], format_count(m["x"]), str(m["iteration"] or ""), measured, f"{m['loss']:.4f}",
                      baseline_x, f"{100 * m['share']:.1f}%")
    console.print(table)
    if any(m["extrapolated"] for m in report["matches"]):
        console.print(f"* beyond the {report['baseline']} runs: the curve extrapolated")


def scaling_cli(runs: Sequence[str], by: str = "params", metric: str = "valid_loss", baseline: str = "softmax",
                at: Sequence[str] = (), start: str | None = None, output: str | None = None) -> int:
    """`megadiff scaling RUN...`: print the fits and matches (and write them as JSON)."""
    if by not in AXES:
        raise ConfigError(f"--by must be one of {AXES}, got {by!r}")
    sizes = [parse_count(x) for x in at]
    points = [point for run in runs for point in run_points(run, by, metric)]
    report = scaling_report(points, by, baseline, sizes, parse_count(start) if start else 0.0)
    report.update(metric=metric, points=[asdict(p) for p in points])
    console = plain_console()
    _print(console, report, metric)
    write_report(console, report, output)
    return 0
