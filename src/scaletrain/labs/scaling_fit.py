"""The fit of the scaling-law lab (labs/scaling_law.py is its command): loss = a x^(-b) + c over the sizes of
finished runs, with intervals, a prediction at a larger size, and the measured reasons to trust it or not
(Hestness et al. 2017, Kaplan et al. 2020).

The fit minimizes the squared error of log(loss), so every point weighs by its relative error, with a > 0,
b > 0, c >= 0, started from the best b of a grid (for each b, a and c are a linear least-squares fit):
curve_fit then never starts far off. Its covariance gives each parameter a 95% interval (Student's t, n - 3
degrees of freedom) and the prediction one by the delta method. How far that prediction can be trusted is
said in numbers: how far it extrapolates, how well the fit matches its points, and how well the same fit
without the largest point predicted that point.

    law = fit_power_law(xs, losses)
    law.b, law.intervals()["b"], law.predict(10 * max(xs))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.errors import UserError
from scaletrain.labs.output import LAB_FILE

MIN_POINTS = 4  # 3 parameters and at least one degree of freedom for their error
LEVEL = 0.95


# ------------------------------------------------------------------------------------------- the fit


def _log_model(u: np.ndarray, a1: float, b: float, c: float) -> np.ndarray:
    """log(a1 u^-b + c), u = x / x0: the fit's model, in its own unit of x."""
    return np.log(a1 * u ** (-b) + c)


@dataclass(frozen=True)
class PowerLaw:
    """loss = a x^-b + c, fit in the unit x0 (the geometric mean of the xs): internally a1 = a x0^-b."""

    a1: float
    b: float
    c: float
    x0: float
    cov: np.ndarray  # (3, 3) covariance of (a1, b, c); inf where the data do not determine them
    dof: int  # points - 3
    rms: float  # residual rms of log(loss): about the relative error of a point

    @property
    def a(self) -> float:
        return self.a1 * self.x0 ** self.b

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        return self.a1 * (np.asarray(x, dtype=float) / self.x0) ** (-self.b) + self.c

    def t(self, level: float = LEVEL) -> float:
        from scipy.stats import t

        return float(t.ppf(0.5 + level / 2, self.dof))

    def errors(self) -> dict[str, float]:
        """Standard errors of a (in x's own unit), b and c."""
        cov = self.cov
        grad_a = np.array([self.x0 ** self.b, self.a * math.log(self.x0), 0.0])  # d a / d (a1, b, c)
        var_a = float(grad_a @ cov @ grad_a) if np.all(np.isfinite(cov)) else math.inf
        return {"a": math.sqrt(max(var_a, 0.0)), "b": math.sqrt(max(cov[1, 1], 0.0)),
                "c": math.sqrt(max(cov[2, 2], 0.0))}

    def intervals(self, level: float = LEVEL) -> dict[str, tuple[float, float]]:
        """Each parameter +- t standard errors, the low end clipped at the bound 0 that the fit keeps."""
        t = self.t(level)
        return {name: (max(value - t * err, 0.0), value + t * err)
                for (name, err), value in zip(self.errors().items(), (self.a, self.b, self.c))}

    def predict(self, x: np.ndarray | float, level: float = LEVEL) -> tuple[np.ndarray, ...]:
        """(loss, low, high) at ``x``: the delta method on log(loss), then back (always positive)."""
        u = np.atleast_1d(np.asarray(x, dtype=float)) / self.x0
        power = u ** (-self.b)
        mid = self.a1 * power + self.c
        # d log(loss) / d (a1, b, c): (n, 3)
        grad = np.stack([power, -self.a1 * power * np.log(u), np.ones_like(u)], axis=1) / mid[:, None]
        with np.errstate(invalid="ignore"):
            sd = np.sqrt(np.einsum("ni,ij,nj->n", grad, self.cov, grad))
        sd = np.where(np.isfinite(sd), sd, np.inf)
        spread = np.exp(self.t(level) * sd)
        return mid, mid / spread, mid * spread


def _start(u: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(a1, b, c) of the best b on a grid, a and c by linear least squares for each (c clipped at 0)."""
    best, found = math.inf, (float(y.max() - y.min()) or 1.0, 0.5, float(y.min()) / 2)
    for b in np.geomspace(1e-3, 5.0, 160):
        power = u ** (-b)
        (a1, c), *_ = np.linalg.lstsq(np.stack([power, np.ones_like(u)], axis=1), y, rcond=None)
        if c < 0:
            a1, c = float(power @ y / (power @ power)), 0.0
        if a1 <= 0:
            continue
        err = float(np.sum((np.log(a1 * power + c) - np.log(y)) ** 2))
        if err < best:
            best, found = err, (float(a1), float(b), float(c))
    return found


def fit_power_law(x: Any, loss: Any) -> PowerLaw:
    """Fit loss = a x^-b + c (a > 0, b > 0, c >= 0) by least squares on log(loss); at least 4 points."""
    from scipy.optimize import curve_fit

    xs, ys = np.asarray(x, dtype=float), np.asarray(loss, dtype=float)
    assert xs.shape == ys.shape and len(xs) >= MIN_POINTS, "checked by the caller (check_points())"
    x0 = float(np.exp(np.mean(np.log(xs))))
    u, logy = xs / x0, np.log(ys)
    a1, b, c = _start(u, ys)
    p0 = (a1, min(max(b, 1e-6), 9.9), max(c, 1e-9 * float(ys.min())))
    try:
        with np.errstate(over="ignore"):  # a search step through huge b: its exp overflows, and is rejected
            params, cov = curve_fit(_log_model, u, logy, p0=p0, bounds=([0.0, 0.0, 0.0], [np.inf, 10.0, np.inf]),
                                    maxfev=20000)
    except (RuntimeError, ValueError):  # no convergence: the grid's start is the best estimate there is
        params, cov = np.array(p0), np.full((3, 3), np.inf)
    residual = _log_model(u, *params) - logy
    cov = np.where(np.isfinite(cov), cov, np.inf)
    return PowerLaw(*(float(p) for p in params), x0=x0, cov=cov, dof=len(xs) - 3,
                    rms=float(np.sqrt(np.mean(residual ** 2))))


# ------------------------------------------------------------------------------------------- points


@dataclass(frozen=True)
class Point:
    x: float
    loss: float
    source: str  # the run directory
    kind: str  # "eval" or "train": which loss this is
    # what one law holds fixed (empty where not read): the data and model family, the data seen, the size
    family: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    samples: float = field(default=0.0, compare=False)
    params: float = field(default=0.0, compare=False)


# config keys that make runs one family: the same data, the same kind of model reading it the same way
FAMILY_KEYS = (("data", "source"), ("data", "path"), ("model", "name"), ("data", "seq_len"), ("model", "vocab_size"))


def _family(path: Path) -> tuple[tuple[str, Any], ...]:
    from scaletrain.observe.report.load import CONFIG, read_config

    cfg = read_config(path / CONFIG) or {}
    token = (cfg.get("model") or {}).get("name") in ("gpt", "llama")
    return tuple((f"{sec}.{key}", (cfg.get(sec) or {}).get(key)) for sec, key in FAMILY_KEYS
                 if token or (sec, key) not in (("data", "seq_len"), ("model", "vocab_size")))


def check_family(points: list[Point], x_kind: str) -> None:
    """One law is one recipe: the runs read the same data with the same kind of model, and all but x is held
    fixed (--x params: the same samples seen; --x tokens or samples: the same model size). A fit across other
    runs is a curve through unrelated numbers: one line naming two runs and what differs."""
    first = points[0]
    for p in points[1:]:
        for (key, want), (_, got) in zip(first.family, p.family):
            if want != got:
                raise UserError(f"RUN_DIR: {first.source} and {p.source} differ in {key} ({want!r} and {got!r}): "
                                "a scaling law is a law of one recipe; fix: pass runs of one data source and "
                                "model family")
        if x_kind == "params":
            held, what, fix = "samples", "the data seen (samples)", \
                "runs of the same --steps and batch, or --x samples for runs of one size"
        else:
            held, what, fix = "params", "the model size (parameters)", \
                "runs of one model, or --x params for runs of one budget"
        a, b = getattr(first, held), getattr(p, held)
        if a and b and abs(a - b) > 0.01 * max(a, b):
            raise UserError(f"RUN_DIR: {first.source} and {p.source} differ in {what}: {a:,.0f} and {b:,.0f}; "
                            f"a law in {x_kind} holds everything else fixed; fix: {fix}")


def _number(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _tokens_per_sample(path: Path, summary: dict[str, Any]) -> int:
    from scaletrain.observe.report.load import CONFIG, read_config

    seq_len = ((read_config(path / CONFIG) or {}).get("data") or {}).get("seq_len")
    if "tokens_per_s" not in summary or not _number(seq_len):
        raise UserError(f"--x tokens: {path} did not train on token sequences (its summary.json has no "
                        "tokens_per_s, or its config.toml no data.seq_len); fix: --x samples, or --x params")
    return int(seq_len)


def _x_of(path: Path, summary: dict[str, Any], x_kind: str) -> float:
    key = "params" if x_kind == "params" else "samples"
    value = summary.get(key)
    if not _number(value):
        raise UserError(f"{path}/summary.json: no positive {key!r} (x for --x {x_kind}); fix: pass runs that "
                        "`scaletrain train` finished, or another --x")
    return float(value) * (_tokens_per_sample(path, summary) if x_kind == "tokens" else 1)


def read_point(path: Path, x_kind: str) -> Point:
    """One finished run's (x, final loss): the eval loss, else the train loss (the point says which)."""
    from scaletrain.observe.report.load import SUMMARY, read_summary

    summary = read_summary(path / SUMMARY) if path.is_dir() else None
    if summary is None and (path / LAB_FILE).is_file():
        raise UserError(f"RUN_DIR = {str(path)!r}: a lab's directory (lab.json), not a training run; fix: "
                        "pass directories that `scaletrain train` finished, e.g. the w*-s* runs that --sizes "
                        "made")
    if summary is None:
        raise UserError(f"RUN_DIR = {str(path)!r}: not a finished run (no {SUMMARY}); fix: pass "
                        "directories that `scaletrain train` finished (their --run.dir), or --sizes "
                        "16,32,64,128 to train some")
    x = _x_of(path, summary, x_kind)
    held = {"family": _family(path), "samples": float(summary.get("samples") or 0),
            "params": float(summary.get("params") or 0)}
    loss = (summary.get("eval") or {}).get("loss")
    if _number(loss):
        return Point(x, float(loss), str(path), "eval", **held)
    if _number(summary.get("train_loss")):
        return Point(x, float(summary["train_loss"]), str(path), "train", **held)
    raise UserError(f"{path}/summary.json: neither eval.loss nor train_loss is a positive number; fix: pass "
                    "runs that finished with a finite loss")


def check_points(points: list[Point], more: int = 0) -> None:
    """Enough runs of enough sizes for three parameters and their error (``more``: runs of other sizes still to
    come, checked before they train); one line with the fix where not."""
    sizes = {p.x for p in points}
    if len(points) + more < MIN_POINTS or len(sizes) + more < 3:
        raise UserError(f"scaling-law needs at least {MIN_POINTS} runs of at least 3 sizes to fit a x^-b + c "
                        f"(3 parameters) with an error bar; got {len(points) + more} run(s) of "
                        f"{len(sizes) + more if more else len(sizes)} size(s); fix: add run directories, or "
                        "--sizes 8,16,32,64")


# ------------------------------------------------------------------------------------------- reading


def leave_last_out(points: list[Point], level: float = LEVEL) -> dict[str, Any] | None:
    """The same fit without the largest size, predicting it: a measured check of extrapolation (5+ points)."""
    largest = max(p.x for p in points)
    rest = [p for p in points if p.x < largest]
    if len(rest) < MIN_POINTS or len({p.x for p in rest}) < 3:
        return None
    law = fit_power_law([p.x for p in rest], [p.loss for p in rest])
    measured = float(np.mean([p.loss for p in points if p.x == largest]))
    mid, lo, hi = (float(v[0]) for v in law.predict(largest, level))
    return {"x": largest, "from_x": max(p.x for p in rest), "measured": measured, "predicted": mid, "low": lo,
            "high": hi, "error": mid / measured - 1, "inside": lo <= measured <= hi}


def _trust(law: PowerLaw, points: list[Point], factor: float, width: float,
           check: dict[str, Any] | None) -> tuple[str, list[str]]:
    """'good', 'fair' or 'low', and the measured reasons."""
    reasons, level = [], 2
    if factor > 10:
        reasons.append(f"it extrapolates {factor:.0f}x beyond the largest size measured")
        level = min(level, 0)
    elif factor > 3:
        reasons.append(f"it extrapolates {factor:.1f}x beyond the largest size measured")
        level = min(level, 1)
    if len(points) < 6:
        reasons.append(f"{len(points)} points leave {law.dof} degree(s) of freedom for the error")
        level = min(level, 1)
    if not math.isfinite(width) or width > 0.1:
        reasons.append("its 95% interval is wider than +-10%")
        level = min(level, 0)
    if check is not None and not check["inside"]:
        reasons.append(f"without its largest point the fit missed that point by {check['error']:+.1%}, "
                       "outside its own interval")
        level = min(level, 0)
    c_low, c_high = law.intervals()["c"]
    if law.c > 0 and (c_high - c_low) / 2 > 0.1 * min(p.loss for p in points):
        reasons.append(f"the floor c is not pinned down (95%: {c_low:.3f} to {c_high:.3f}), so the curve's "
                       "bend beyond the data is a guess")
        level = min(level, 1)
    if law.c == 0.0:
        reasons.append("c fell to its bound 0: the points show no floor yet, so the fit cannot place one")
        level = min(level, 1)
    return ("low", "fair", "good")[level], reasons


def analyse(points: list[Point], x_predict: float | None, x_kind: str) -> dict[str, Any]:
    """The fit, the prediction and the check, as the JSON-able numbers of lab.json."""
    law = fit_power_law([p.x for p in points], [p.loss for p in points])
    largest = max(p.x for p in points)
    x_at = x_predict if x_predict is not None else 10 * largest
    mid, lo, hi = (float(v[0]) for v in law.predict(x_at))
    check = leave_last_out(points)
    width = max(hi / mid - 1, 1 - lo / mid)
    trust, reasons = _trust(law, points, x_at / largest, width, check)
    return _json_safe({"x_kind": x_kind, "level": LEVEL,
            "points": [{"x": p.x, "loss": p.loss, "loss_kind": p.kind, "run": p.source} for p in points],
            "fit": {"a": law.a, "b": law.b, "c": law.c, "x0": law.x0, "a1": law.a1, "dof": law.dof,
                    "rms_log_residual": law.rms, "errors": law.errors(),
                    "intervals": {k: list(v) for k, v in law.intervals().items()},
                    "cov_a1_b_c": law.cov.tolist()},
            "prediction": {"x": x_at, "loss": mid, "low": lo, "high": hi, "factor": x_at / largest},
            "leave_last_out": check, "trust": trust, "trust_reasons": reasons})


def _json_safe(value: Any) -> Any:
    """``value`` with None for each infinite or nan float (what the data did not determine): JSON has none."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def law_of(nums: dict[str, Any]) -> PowerLaw:
    """The fit back from lab.json's numbers."""
    fit = nums["fit"]
    cov = np.array([[math.inf if v is None else v for v in row] for row in fit["cov_a1_b_c"]])
    return PowerLaw(fit["a1"], fit["b"], fit["c"], fit["x0"], cov, fit["dof"], fit["rms_log_residual"])


def _shown(value: float | None, spec: str) -> str:
    """A number of lab.json as the reading shows it (None: the data did not determine it)."""
    return "undetermined" if value is None else f"{value:{spec}}"


def _range(low: float | None, high: float | None, spec: str = ".4f") -> str:
    return f"[{_shown(low, spec)}, {_shown(high, spec)}]"


def _interval(name: str, fit: dict[str, Any], spec: str) -> str:
    return f"{_shown(fit[name], spec)} {_range(*fit['intervals'][name], spec)}"


def reading(nums: dict[str, Any]) -> list[str]:
    fit, pred, check, unit = nums["fit"], nums["prediction"], nums["leave_last_out"], nums["x_kind"]
    xs = [p["x"] for p in nums["points"]]
    fitted = (f"{len(xs)} runs from {min(xs):,.0f} to {max(xs):,.0f} {unit}: loss = a x^-b + c with b = "
              f"{_interval('b', fit, '.3f')} and c = {_interval('c', fit, '.3f')} (95% intervals; a = "
              f"{_interval('a', fit, '.3g')}); the points sit {fit['rms_log_residual']:.1%} (rms) off the "
              "curve.")
    slope = (f"Each 10x in {unit} takes {1 - 10 ** -fit['b']:.0%} off the loss above its floor c: that part "
             "shrinks as a power law, the floor does not.")
    predicted = (f"Predicted loss at {pred['x']:,.0f} {unit} ({pred['factor']:.3g}x the largest run): "
                 f"{pred['loss']:.4f}, 95% interval {_range(pred['low'], pred['high'])}.")
    said = [fitted, slope, predicted]
    if check is not None:
        said.append(f"Check: fit without the largest run ({check['x']:,.0f} {unit}), the law predicted "
                    f"{check['predicted']:.4f} {_range(check['low'], check['high'])} for it from "
                    f"{check['x'] / check['from_x']:.3g}x smaller runs; it measured {check['measured']:.4f} "
                    f"({check['error']:+.1%}, {'inside' if check['inside'] else 'outside'} the interval).")
    reasons = "; ".join(nums["trust_reasons"]) or "it extrapolates little, from enough points that fit well"
    said.append(f"Trust in the prediction: {nums['trust']} ({reasons}).")
    trained = [p["run"] for p in nums["points"] if p["loss_kind"] == "train"]
    if trained:
        said.append(f"{len(trained)} run(s) had no eval loss, so their train loss is used: "
                    f"{', '.join(trained)}.")
    return said


def rows(nums: dict[str, Any]) -> list[tuple[str, str]]:
    fit, pred, check = nums["fit"], nums["prediction"], nums["leave_last_out"]
    predicted = f"{pred['loss']:.4f} {_range(pred['low'], pred['high'])} ({pred['factor']:.3g}x the largest)"
    out = [("law", "loss = a x^-b + c, fit on log(loss)"),
           ("points", f"{len(nums['points'])} runs, x = {nums['x_kind']}"),
           ("a (95%)", _interval("a", fit, ".4g")), ("b (95%)", _interval("b", fit, ".4f")),
           ("c (95%)", _interval("c", fit, ".4f")),
           ("residual rms", f"{fit['rms_log_residual']:.2%} of the loss"),
           (f"predicted at {pred['x']:,.0f}", predicted)]
    if check is not None:
        checked = (f"predicted {check['predicted']:.4f}, measured {check['measured']:.4f} "
                   f"({check['error']:+.1%})")
        out.append(("leave-last-out", checked))
    out.append(("trust", nums["trust"]))
    return out


# ------------------------------------------------------------------------------------------- figure


def figure(nums: dict[str, Any]) -> Any:
    """Left: loss against x (log x), the points, the fit with its 95% band, the floor c and the prediction
    with its interval. Right: loss - c against x, where the power law is a straight line of slope -b."""
    from matplotlib.figure import Figure

    pred, law = nums["prediction"], law_of(nums)
    xs = np.array([p["x"] for p in nums["points"]])
    ys = np.array([p["loss"] for p in nums["points"]])
    grid = np.geomspace(min(xs.min(), pred["x"]) / 1.3, max(xs.max(), pred["x"]) * 1.3, 200)
    mid, lo, hi = (np.where(np.isfinite(v), v, np.nan) for v in law.predict(grid))
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.fill_between(grid, lo, hi, color="#1f77b4", alpha=0.15, label="95% band")
    left.plot(grid, mid, color="#1f77b4", label=f"fit: {law.a:.3g} x^-{law.b:.3f} + {law.c:.3f}")
    left.plot(xs, ys, "ko", ms=5, label="runs")
    low, high = (pred["loss"] if v is None else v for v in (pred["low"], pred["high"]))
    below, above = pred["loss"] - low, high - pred["loss"]
    left.errorbar([pred["x"]], [pred["loss"]], yerr=[[below], [above]], fmt="D", color="#d62728", capsize=4,
                  label=f"prediction ({pred['factor']:.3g}x)")
    if law.c > 0.5 * ys.min():  # lower, the floor line would squash the points into a band
        left.axhline(law.c, color="gray", ls="--", lw=1, label=f"floor c = {law.c:.3f}")
    left.set_ylabel("loss")
    right.plot(grid, mid - law.c, color="#1f77b4", label=f"slope -b = -{law.b:.3f}")
    shown = ys - law.c > 0  # a point below the floor has no place on a log axis
    right.plot(xs[shown], ys[shown] - law.c, "ko", ms=5, label="runs")
    right.plot([pred["x"]], [pred["loss"] - law.c], "D", color="#d62728", label="prediction")
    right.set_yscale("log")
    right.set_ylabel("loss - c")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel(nums["x_kind"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Scaling law over {nums['x_kind']}: trust in the prediction {nums['trust']}")
    return fig
