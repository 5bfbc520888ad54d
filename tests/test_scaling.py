"""`megadiff scaling` (the DIFF paper's Figure 3) on run directories whose validation losses follow
known power laws: the fits recover the laws, and each match is the size that the baseline's law
itself needs for the same loss (solved here in closed form)."""
from __future__ import annotations

import json
import math

import pytest

from megadiff.analysis.scaling import PowerLaw, fit_power_law, parse_count, run_points
from megadiff.cli import main
from megadiff.config import dump_config, load_config
from megadiff.models.param_count import count_parameters
from tests.pretrain_runs import ROOT

SIZES = ["830m", "1.4b", "2.8b", "6.8b", "13.1b"]
# two laws with DIFF below softmax at every size (the paper publishes its fitted curves only as a
# figure); alpha and X_c of L(N) = (X_c / N)^alpha
LAWS = {"softmax": (0.076, 8.8e13), "diff": (0.072, 3.9e13)}


def law_loss(variant: str, x: float) -> float:
    alpha, scale = LAWS[variant]
    return (scale / x) ** alpha


def baseline_size_for(variant: str, x: float) -> float:
    """Where the softmax law reaches `variant`'s loss at x: (s_b / X')^a_b = (s_v / x)^a_v."""
    (a_b, s_b), (a_v, s_v) = LAWS["softmax"], LAWS[variant]
    return s_b * (x / s_v) ** (a_v / a_b)


def paper_size(variant: str, size: str, overrides: tuple[str, ...] = ()) -> float:
    count = count_parameters(load_config(ROOT / "configs" / "scaling" / f"{variant}-{size}.yaml", overrides).model)
    return float(count.non_embedding + count.embedding)


def write_run(directory, config_path, overrides, valid: dict[int, float], batch_sizes: dict[int, int] | None = None):
    """A run directory as pretrain leaves it: its config and metrics.jsonl (training records between
    the validation ones); `batch_sizes`: {first iteration: global batch size} of a run that changed it
    on resume (its config holds the last)."""
    directory.mkdir(parents=True)
    cfg = load_config(config_path, overrides)
    dump_config(cfg, directory / "config.yaml")
    lines, consumed, batch = [], 0, cfg.train.global_batch_size
    for iteration in range(1, max(valid) + 1):
        batch = (batch_sizes or {}).get(iteration, batch)
        consumed += batch
        lines.append({"iteration": iteration, "lm_loss": 9.0, "consumed_samples": consumed})
        if iteration in valid:
            lines.append({"iteration": iteration, "valid_loss": valid[iteration]})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


@pytest.fixture(scope="module")
def size_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    runs = []
    for variant in LAWS:
        for size in SIZES:
            config = ROOT / "configs" / "scaling" / f"{variant}-{size}.yaml"
            # an early evaluation first: only each run's last loss counts
            runs.append(write_run(root / f"{variant}-{size}", config, ["train.iters=4"],
                                  {2: 11.0, 4: law_loss(variant, paper_size(variant, size))}))
    return runs


def test_power_law_fit_recovers_the_law():
    law = PowerLaw(0.07, 2e14)
    xs = [1e8, 5e8, 3e9, 2e10]
    fitted = fit_power_law(xs, [law.loss(x) for x in xs])
    assert fitted.alpha == pytest.approx(0.07, rel=1e-9) and fitted.scale == pytest.approx(2e14, rel=1e-6)
    assert fitted.reaching(law.loss(7e9)) == pytest.approx(7e9, rel=1e-6)
    with pytest.raises(ValueError, match="do not fall"):
        fit_power_law(xs, [1.0, 1.1, 1.2, 1.3])
    with pytest.raises(ValueError, match="two sizes"):
        fit_power_law([1e9, 1e9], [2.0, 2.1])
    with pytest.raises(ValueError, match=r"fall too little as X grows \(exponent 8e-05\)"):
        fit_power_law([1e6, 2e6], [10.8656, 10.8650])  # its scale, e^30000, is no float
    with pytest.raises(ValueError, match="fall too little"):
        fit_power_law([1e6, 2e6], [0.86560, 0.86555])  # its scale, e^-1700, is 0.0 as a float


def test_counts_read_as_the_papers_write_them():
    assert [parse_count(x) for x in ("6.8B", "160b", "7.8e9", "500M", "2T", "40000")] == [
        6.8e9, 160e9, 7.8e9, 500e6, 2e12, 40000.0]


def test_each_size_is_matched_to_the_baselines_law(size_runs, tmp_path, capsys):
    out = tmp_path / "scaling.json"
    assert main(["scaling", *map(str, size_runs), "--at", "7.8B", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    for variant, (alpha, scale) in LAWS.items():
        fit = report["fits"][variant]
        assert fit["alpha"] == pytest.approx(alpha, rel=1e-6) and fit["scale"] == pytest.approx(scale, rel=1e-4)
        assert fit["points"] == len(SIZES)
    matches = report["matches"]
    assert [m["run"] for m in matches[:-1]] == [str(run) for run in size_runs if "diff" in run.name]
    for m, size in zip(matches, SIZES):
        x = paper_size("diff", size)
        assert m["x"] == x and m["iteration"] == 4 and m["measured_loss"] == pytest.approx(law_loss("diff", x))
        assert m["baseline_x"] == pytest.approx(baseline_size_for("diff", x), rel=1e-5)
        assert m["share"] == pytest.approx(x / baseline_size_for("diff", x), rel=1e-5)
        low, high = paper_size("softmax", "830m"), paper_size("softmax", "13.1b")
        assert m["extrapolated"] == (not low <= m["baseline_x"] <= high)
    asked = matches[-1]
    assert asked["run"] is None and asked["x"] == 7.8e9
    assert asked["baseline_x"] == pytest.approx(baseline_size_for("diff", 7.8e9), rel=1e-5)
    printed = capsys.readouterr().out
    assert "on the softmax curve, by parameters" in printed and f"{100 * asked['share']:.1f}%" in printed


def test_tokens_follow_each_evaluation_from_the_first_kept(tmp_path):
    """By tokens: every logged validation loss at iteration x global batch x sequence length; the
    first evaluation (off the law, as early training is) is left out with --from."""
    config = ROOT / "configs" / "demo" / "diff-tiny.yaml"
    tokens_per_iteration = 16 * 256
    runs = []
    for variant in LAWS:
        valid = {it: law_loss(variant, it * tokens_per_iteration * 1e4) for it in range(20, 101, 20)}
        valid[10] = 12.0
        runs.append(write_run(tmp_path / variant, config, [f"model.variant={variant}", "train.global_batch_size=16",
                                                           "model.seq_length=256", "train.iters=100"],
                              dict(sorted(valid.items()))))
    out = tmp_path / "tokens.json"
    assert main(["scaling", *map(str, runs), "--by", "tokens", "--from", str(20 * tokens_per_iteration),
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(p["iteration"], p["x"]) for p in report["points"] if p["variant"] == "diff"] == [
        (it, it * tokens_per_iteration) for it in (10, 20, 40, 60, 80, 100)]
    for variant, (alpha, _) in LAWS.items():
        assert report["fits"][variant]["alpha"] == pytest.approx(alpha, rel=1e-6)
        assert report["fits"][variant]["points"] == 5
    assert [m["iteration"] for m in report["matches"]] == [20, 40, 60, 80, 100]
    for m in report["matches"]:
        # the runs' laws are in tokens x 1e4: the baseline's tokens are that map's inverse
        expected = baseline_size_for("diff", m["x"] * 1e4) / 1e4
        assert m["baseline_x"] == pytest.approx(expected, rel=1e-5)
    assert main(["scaling", *map(str, runs), "--by", "tokens", "--output", str(out)]) == 0
    with_first = json.loads(out.read_text())["fits"]["diff"]
    assert with_first["points"] == 6 and not math.isclose(with_first["alpha"], LAWS["diff"][0], rel_tol=1e-3)


def test_tokens_are_those_read_when_a_run_changed_its_batch_size(tmp_path):
    """Resumed at iteration 51 with global batches of 32 (its config.yaml says 32): an evaluation's tokens
    are the samples read by then, not its iteration times the last batch size."""
    config = ROOT / "configs" / "demo" / "diff-tiny.yaml"
    run = write_run(tmp_path / "diff", config, ["train.global_batch_size=32", "model.seq_length=256"],
                    {40: 4.0, 80: 3.5}, batch_sizes={1: 16, 51: 32})
    points = run_points(run, "tokens")
    assert [(p.iteration, p.x) for p in points] == [(40, 40 * 16 * 256), (80, (50 * 16 + 30 * 32) * 256)]


def test_mistakes_are_named(size_runs, tmp_path, capsys):
    diff_runs = [str(run) for run in size_runs if "diff" in run.name]
    assert main(["scaling", *diff_runs]) == 2
    assert "no point of the baseline variant softmax (the runs are diff)" in capsys.readouterr().err
    assert main(["scaling", *diff_runs, "--baseline", "diff", "--at", "seven"]) == 2
    assert "'seven' is not a count" in capsys.readouterr().err
    assert main(["scaling", diff_runs[0], str(size_runs[0])]) == 2
    assert "the baseline (softmax) needs points at two sizes" in capsys.readouterr().err
    assert main(["scaling", str(tmp_path)]) == 2
    assert "is not a run's output_dir" in capsys.readouterr().err
    silent = write_run(tmp_path / "silent", ROOT / "configs" / "scaling" / "diff-830m.yaml", [], {1: 3.0})
    (silent / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "lm_loss": 3.0}) + "\n")
    assert main(["scaling", str(silent)]) == 2
    assert "logged no valid_loss: runs log it every train.eval_interval" in capsys.readouterr().err
    diverged = write_run(tmp_path / "diverged", ROOT / "configs" / "scaling" / "diff-830m.yaml", [],
                         {1: 3.0, 2: float("nan")})
    assert main(["scaling", str(diverged)]) == 2
    assert "valid_loss is not a positive number at iteration 2" in capsys.readouterr().err
    unfinished = write_run(tmp_path / "unfinished", ROOT / "configs" / "scaling" / "diff-830m.yaml", [], {2: 3.0})
    assert main(["scaling", str(unfinished), *diff_runs]) == 2
    assert "stopped at iteration 2 of its 40000 (train.iters): by size a run counts once trained" in \
        capsys.readouterr().err
    assert main(["scaling", "--by", "tokens", str(unfinished), *diff_runs, "--baseline", "diff"]) == 0
    # finished before runs evaluated after their last iteration: its last evaluation is said to be earlier
    early = write_run(tmp_path / "early", ROOT / "configs" / "scaling" / "diff-830m.yaml", ["train.iters=4"], {2: 3.0})
    with (early / "metrics.jsonl").open("a") as metrics:
        metrics.write("".join(json.dumps({"iteration": i, "lm_loss": 9.0}) + "\n" for i in (3, 4)))
    with pytest.warns(UserWarning, match="its last valid_loss is at iteration 2 of 4"):
        assert [p.loss for p in run_points(early, "params")] == [3.0]


def least_squares_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) from the normal equations."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


def test_a_variant_is_matched_at_its_fitted_curve_or_else_at_its_one_point(size_runs, tmp_path):
    """Noisy DIFF runs are matched at their curve's losses, not their own; a variant with one run
    (DINT here) at its measured loss."""
    noise = [0.01, -0.02, 0.015, -0.005, 0.0]
    scaling = ROOT / "configs" / "scaling"
    diff_runs = [write_run(tmp_path / f"diff-{size}", scaling / f"diff-{size}.yaml", ["train.iters=1"],
                           {1: law_loss("diff", paper_size("diff", size)) + delta})
                 for size, delta in zip(SIZES, noise)]
    dint = write_run(tmp_path / "dint", scaling / "diff-1.4b.yaml", ["model.variant=dint", "train.iters=1"], {1: 2.3})
    softmax_runs = [str(run) for run in size_runs if "softmax" in run.name]
    out = tmp_path / "report.json"
    assert main(["scaling", *softmax_runs, *map(str, diff_runs), str(dint), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    xs = [paper_size("diff", size) for size in SIZES]
    slope, intercept = least_squares_line([math.log(x) for x in xs],
                                          [math.log(law_loss("diff", x) + d) for x, d in zip(xs, noise)])
    assert report["fits"]["diff"]["alpha"] == pytest.approx(-slope, rel=1e-6)
    assert set(report["fits"]) == {"softmax", "diff"}  # one DINT run draws no curve
    *diff_matches, dint_match = report["matches"]
    for m, x, delta in zip(diff_matches, xs, noise):
        fitted = math.exp(intercept + slope * math.log(x))
        assert m["loss"] == pytest.approx(fitted, rel=1e-6)
        assert m["measured_loss"] == pytest.approx(law_loss("diff", x) + delta)
        alpha, scale = LAWS["softmax"]
        assert m["baseline_x"] == pytest.approx(scale * fitted ** (-1 / alpha), rel=1e-5)
    assert dint_match["variant"] == "dint" and dint_match["loss"] == 2.3
    assert dint_match["baseline_x"] == pytest.approx(LAWS["softmax"][1] * 2.3 ** (-1 / LAWS["softmax"][0]), rel=1e-5)


def test_ablation_runs_draw_their_own_curves_beside_their_variants(size_runs, tmp_path):
    """Table 6's arms passed with the scaling runs: DIFF without its head norm, DIFF at another lambda_init and a
    Transformer with a head norm each get a curve of their own; the plain fits are those without them."""
    scaling = ROOT / "configs" / "scaling"
    arms = {"diff(head_norm=false)": ("diff", ("model.head_norm=false",), 1.01),
            "diff(lambda_init=0.8)": ("diff", ("model.lambda_init=0.8",), 1.02),
            "softmax(head_norm=true)": ("softmax", ("model.head_norm=true",), 0.99)}
    ablations = []
    for arm, (variant, overrides, factor) in arms.items():
        for size in SIZES[:2]:
            directory = tmp_path / f"{arm}-{size}"
            ablations.append(write_run(directory, scaling / f"{variant}-{size}.yaml", ["train.iters=1", *overrides],
                                       {1: factor * law_loss(variant, paper_size(variant, size, overrides))}))
    out = tmp_path / "report.json"
    assert main(["scaling", *map(str, size_runs), *map(str, ablations), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["fits"]) == {"softmax", "diff", *arms}
    for variant, (alpha, scale) in LAWS.items():  # the plain curves, untouched by the ablations
        assert report["fits"][variant]["alpha"] == pytest.approx(alpha, rel=1e-6)
        assert report["fits"][variant]["points"] == len(SIZES)
    for arm, (variant, _, factor) in arms.items():
        alpha, scale = LAWS[variant]  # factor * (X_c / x)^alpha = (X_c factor^(1/alpha) / x)^alpha
        assert report["fits"][arm]["alpha"] == pytest.approx(alpha, rel=1e-6)
        assert report["fits"][arm]["scale"] == pytest.approx(scale * factor ** (1 / alpha), rel=1e-4)
    assert {m["variant"] for m in report["matches"]} == {"diff", *arms}
