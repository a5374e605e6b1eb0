"""The scaling-law lab (labs/scaling_fit.py, labs/scaling_law.py): the fit of loss = a x^-b + c recovers known
parameters (noise-free: to 1e-6 relative; with 1% noise: inside its own 95% intervals about 95% of the time),
run directories become points, too few of them is one line, and --sizes trains through the real trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scaletrain.cli.options import Parser
from scaletrain.errors import UserError
from scaletrain.labs import scaling_fit as sf
from scaletrain.labs import scaling_law

# (a, b, c, smallest x, largest x): a byte-level model's widths, Kaplan's parameter counts, a flat one.
LAWS = [(5.0, 0.3, 1.5, 1e3, 1e7), (400.0, 0.5, 0.1, 1e5, 1e9), (2.0, 0.08, 2.5, 1e4, 1e6)]


def _law(a: float, b: float, c: float, x: np.ndarray) -> np.ndarray:
    return a * x ** -b + c


@pytest.mark.parametrize("a, b, c, lo, hi", LAWS)
def test_noise_free_points_give_back_the_law(a: float, b: float, c: float, lo: float, hi: float) -> None:
    x = np.geomspace(lo, hi, 8)
    law = sf.fit_power_law(x, _law(a, b, c, x))
    assert (law.a, law.b, law.c) == pytest.approx((a, b, c), rel=1e-6)
    mid, low, high = law.predict(10 * hi)
    assert mid[0] == pytest.approx(_law(a, b, c, 10 * hi), rel=1e-6)
    assert low[0] <= mid[0] <= high[0]
    assert law.rms < 1e-6


@pytest.mark.parametrize("a, b, c, lo, hi", LAWS[:2])
def test_with_one_percent_noise_the_intervals_hold_the_truth_about_95_percent_of_the_time(
        a: float, b: float, c: float, lo: float, hi: float) -> None:
    """8 points, 1% multiplicative noise, 60 seeds: the delta method's 95% intervals (Student's t, 5 degrees
    of freedom) cover the true b, c and the true loss at 10x the largest size in at least 85% of the seeds
    (measured 90-95%), and the median fit of b is within 5% of the true b."""
    x = np.geomspace(lo, hi, 8)
    covered = {"b": 0, "c": 0, "prediction": 0}
    fitted: list[float] = []
    seeds = 60
    for seed in range(seeds):
        noisy = _law(a, b, c, x) * (1 + 0.01 * np.random.default_rng(seed).normal(size=x.size))
        law = sf.fit_power_law(x, noisy)
        intervals = law.intervals()
        _, low, high = law.predict(10 * hi)
        covered["b"] += intervals["b"][0] <= b <= intervals["b"][1]
        covered["c"] += intervals["c"][0] <= c <= intervals["c"][1]
        covered["prediction"] += low[0] <= _law(a, b, c, 10 * hi) <= high[0]
        fitted.append(law.b)
    assert all(n / seeds >= 0.85 for n in covered.values()), covered
    assert np.median(fitted) == pytest.approx(b, rel=0.05)


def test_a_weakly_bent_curve_leaves_c_uncertain_and_the_trust_says_so(tmp_path: Path) -> None:
    """b = 0.08 over two decades hardly bends: c's interval is wide, and the reading's trust names it."""
    a, b, c, lo, hi = LAWS[2]
    x = np.geomspace(lo, hi, 8)
    y = _law(a, b, c, x) * (1 + 0.01 * np.random.default_rng(0).normal(size=x.size))
    points = [sf.Point(float(xi), float(yi), f"run{i}", "eval") for i, (xi, yi) in enumerate(zip(x, y))]
    nums = sf.analyse(points, None, "params")
    assert nums["trust"] in ("fair", "low")
    assert any("floor c is not pinned down" in r for r in nums["trust_reasons"])


def test_leave_last_out_on_an_exact_law_predicts_the_largest_point() -> None:
    x = np.geomspace(1e3, 1e6, 6)
    y = _law(5.0, 0.3, 1.5, x)
    points = [sf.Point(float(xi), float(yi), f"run{i}", "eval") for i, (xi, yi) in enumerate(zip(x, y))]
    check = sf.leave_last_out(points)
    assert check is not None and check["inside"]
    assert abs(check["error"]) < 1e-6
    assert sf.leave_last_out(points[:4]) is None  # 3 points left: no fit with an error


def test_the_default_prediction_is_ten_times_the_largest_and_extrapolating_far_is_low_trust() -> None:
    x = np.geomspace(1e3, 1e6, 6)
    y = _law(5.0, 0.3, 1.5, x) * (1 + 0.005 * np.random.default_rng(1).normal(size=x.size))
    points = [sf.Point(float(xi), float(yi), f"run{i}", "eval") for i, (xi, yi) in enumerate(zip(x, y))]
    nums = sf.analyse(points, None, "params")
    assert nums["prediction"]["x"] == pytest.approx(1e7) and nums["prediction"]["factor"] == pytest.approx(10)
    far = sf.analyse(points, 1e9, "params")
    assert far["trust"] == "low" and "1000x beyond" in far["trust_reasons"][0]
    width, far_width = (n["prediction"]["high"] - n["prediction"]["low"] for n in (nums, far))
    assert far_width > width


def _run_dir(root: Path, name: str, *, params: int, loss: float | None, samples: int = 3200,
             train_loss: float = 9.0, seq_len: int | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    summary = {"params": params, "samples": samples, "train_loss": train_loss, "steps": 100}
    if loss is not None:
        summary["eval"] = {"loss": loss, "count": 100.0}
    if seq_len is not None:
        summary["tokens_per_s"] = 1000.0
        (path / "config.toml").write_text(f"[data]\nseq_len = {seq_len}\n")
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_a_run_directory_becomes_a_point(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, "a", params=1000, loss=2.5, seq_len=64)
    assert sf.read_point(run, "params") == sf.Point(1000.0, 2.5, str(run), "eval")
    assert sf.read_point(run, "samples").x == 3200
    assert sf.read_point(run, "tokens").x == 3200 * 64
    no_eval = _run_dir(tmp_path, "b", params=2000, loss=None, train_loss=2.75)
    assert sf.read_point(no_eval, "params") == sf.Point(2000.0, 2.75, str(no_eval), "train")


@pytest.mark.parametrize("make, x_kind, words", [
    (lambda root: root / "missing", "params", "not a finished run (no summary.json)"),
    (lambda root: _run_dir(root, "images", params=10, loss=1.0), "tokens",
     "did not train on token sequences"),
    (lambda root: _run_dir(root, "zero", params=0, loss=1.0), "params", "no positive 'params'"),
])
def test_a_run_directory_that_is_not_a_usable_run_is_one_line(make, x_kind: str, words: str,
                                                               tmp_path: Path) -> None:
    path = make(tmp_path)
    with pytest.raises(UserError) as err:
        sf.read_point(path, x_kind)
    assert words in str(err.value) and str(path) in str(err.value) and "fix: " in str(err.value)


def test_too_few_points_is_one_line_with_the_fix() -> None:
    points = [sf.Point(float(x), 3.0 - x / 1e4, "r", "eval") for x in (1e3, 2e3, 4e3)]
    with pytest.raises(UserError, match="at least 4 runs of at least 3 sizes.*got 3 run.*fix: "):
        sf.check_points(points)
    sf.check_points(points, more=1)  # a fourth still to train: checked again once it has
    with pytest.raises(UserError, match="got 4 run.*of 2 size"):
        sf.check_points([*points[:2], *points[:2]])


def test_runs_of_other_data_models_or_budgets_are_not_one_law(tmp_path: Path) -> None:
    """A digits MLP among the GPT runs, or GPT runs of other step budgets, were fitted as one law (b = 10, an
    interval to 3.6e11, "inside the interval"): one line naming two runs and what differs."""
    def run(name: str, *, source: str = "stdlib", model: str = "gpt", params: int, samples: int = 3200) -> Path:
        path = _run_dir(tmp_path, name, params=params, loss=3.0 - params / 1e6, samples=samples, seq_len=64)
        (path / "config.toml").write_text(f'[data]\nsource = "{source}"\nseq_len = 64\n[model]\nname = "{model}"\n')
        return path

    gpts = [sf.read_point(run(f"w{n}", params=n), "params") for n in (4_000, 12_000, 36_000)]
    sf.check_family(gpts, "params")
    mlp = sf.read_point(run("mlp", source="digits", model="mlp", params=20_000), "params")
    with pytest.raises(UserError, match=r"differ in data.source \('stdlib' and 'digits'\).*one recipe; fix: "):
        sf.check_family([*gpts, mlp], "params")
    short = sf.read_point(run("short", params=50_000, samples=960), "params")
    with pytest.raises(UserError, match=r"differ in the data seen \(samples\): 3,200 and 960.*fix: runs of the same"):
        sf.check_family([*gpts, short], "params")
    budgets = [sf.read_point(run(f"s{n}", params=36_000, samples=n), "samples") for n in (960, 3200)]
    sf.check_family(budgets, "samples")  # one model, budgets differ: a law in samples
    with pytest.raises(UserError, match=r"differ in the model size \(parameters\): 36,000 and 4,000"):
        sf.check_family([*budgets, sf.read_point(tmp_path / "w4000", "samples")], "samples")


def _parse(argv: list[str]):
    parser = Parser(prog="scaletrain lab")
    scaling_law.add_parser(parser.add_subparsers(dest="lab", parser_class=Parser), "scaling-law")
    return parser.parse_known_args(["scaling-law", *argv])


def test_run_on_run_directories_writes_the_fit_and_the_figure(tmp_path: Path, capsys) -> None:
    widths = [4_000, 12_000, 36_000, 110_000, 330_000]
    runs = [_run_dir(tmp_path, f"w{n}", params=n, loss=float(_law(5.0, 0.3, 1.5, n))) for n in widths]
    args, leftovers = _parse([*map(str, runs), "--predict", "1e6", "--out", str(tmp_path / "lab")])
    assert scaling_law.run(args, leftovers) == 0
    record = json.loads((tmp_path / "lab" / "lab.json").read_text())
    fit = record["numbers"]["fit"]
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((5.0, 0.3, 1.5), rel=1e-4)
    assert record["numbers"]["prediction"]["loss"] == pytest.approx(_law(5.0, 0.3, 1.5, 1e6), rel=1e-4)
    assert record["figures"] == ["scaling_law.png"]
    assert (tmp_path / "lab" / "scaling_law.png").stat().st_size > 10_000
    assert "Predicted loss at 1,000,000 params" in " ".join(record["reading"])
    assert capsys.readouterr().out.rstrip().endswith(f"in {tmp_path / 'lab'}")


@pytest.mark.parametrize("argv, words", [
    ([], "needs run directories or --sizes"),
    (["--sizes", "8,9,16,32"], "widths must be even"),
    (["--sizes", "8,,16"], "--sizes = '8,,16'"),
    (["--sizes", "0,8,16,32"], "--sizes = '0'"),
    (["--sizes", "8,16,32,64", "--x", "tokens"], "--x = 'tokens' with --sizes"),
    (["--sizes", "8,16,32,64", "--steps", "0"], "--steps = '0'"),
    (["--sizes", "8,16,32", "--steps", "1"], "at least 4 runs"),
    (["--x", "flops", "r"], "--x = 'flops': expected one of params, tokens, samples"),
    (["--predict", "-5", "r"], "--predict = '-5'"),
    (["--sizes", "8,16,32,64", "--bogus"], "unexpected argument '--bogus'"),
    (["--sizes", "8,8,8,8"], "a width given twice"),  # it trained one model before refusing
])
def test_bad_input_is_one_line_before_anything_trains(argv: list[str], words: str, tmp_path: Path) -> None:
    args, leftovers = _parse([*argv, "--out", str(tmp_path / "lab")])
    with pytest.raises(UserError) as err:
        scaling_law.run(args, leftovers)
    assert words in str(err.value) and "fix: " in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.glob("lab/w*"))  # nothing trained


def test_sizes_train_through_the_trainer_and_are_reused(tmp_path: Path, capsys) -> None:
    """Four tiny gpt-stdlib widths for 3 steps each (seconds): each a real run directory, reused next time."""
    argv = ["--sizes", "4,6,8,10", "--steps", "3", "--out", str(tmp_path / "lab")]
    assert scaling_law.run(*_parse(argv)) == 0
    first = capsys.readouterr().out
    runs = sorted((tmp_path / "lab").glob("w*-s3"))
    assert [r.name for r in runs] == ["w10-s3", "w4-s3", "w6-s3", "w8-s3"]
    assert all((r / "summary.json").is_file() and (r / "train.log").is_file() for r in runs)
    params = {r.name: json.loads((r / "summary.json").read_text())["params"] for r in runs}
    assert params["w4-s3"] < params["w6-s3"] < params["w8-s3"] < params["w10-s3"]
    assert first.count("trained in") == 4
    assert scaling_law.run(*_parse(argv)) == 0
    assert capsys.readouterr().out.count("reused") == 4
    record = json.loads((tmp_path / "lab" / "lab.json").read_text())
    assert sorted(p["x"] for p in record["numbers"]["points"]) == sorted(params.values())


def test_a_fit_that_does_not_converge_keeps_the_grid_estimate_and_says_undetermined(monkeypatch,
                                                                                   tmp_path: Path) -> None:
    """curve_fit giving up leaves the grid's start (close on exact data) and no covariance: the intervals
    are 'undetermined', lab.json holds null for them (JSON has no inf), and the figure still draws."""
    import scipy.optimize

    def gives_up(*args, **kwargs):
        raise RuntimeError("Optimal parameters not found")

    monkeypatch.setattr(scipy.optimize, "curve_fit", gives_up)
    x = np.geomspace(1e3, 1e6, 6)
    points = [sf.Point(float(xi), float(yi), f"run{i}", "eval")
              for i, (xi, yi) in enumerate(zip(x, _law(5.0, 0.3, 1.5, x)))]
    nums = sf.analyse(points, None, "params")
    assert nums["fit"]["b"] == pytest.approx(0.3, rel=0.05)
    assert nums["prediction"]["high"] is None and nums["trust"] == "low"
    json.dumps(nums, allow_nan=False)
    assert "undetermined" in " ".join(sf.reading(nums)) and "undetermined" in dict(sf.rows(nums))["b (95%)"]
    sf.figure(nums).savefig(tmp_path / "law.png")
