"""The runs of the descent lab (labs/descent.py is its command): gradient descent, SGD and mini-batch SGD on
one least-squares line, their numbers, the reading of them and their figures.

A linear model y = w x + b fit by mean squared error to points drawn around the line y = 2x - 1, whose optimum
(w*, b*) and least loss L* are known in closed form. Three methods take plain gradient steps of one lr from
one start: full-batch gradient descent (GD), SGD (one sample a step) and mini-batch SGD; the stochastic ones
draw their batches without replacement, the data shuffled at every epoch. Each stochastic method runs under
``repeats`` shuffles at once (numpy, vectorized): one of them is the path drawn, and their mean loss is the
expected loss that theory speaks of. A single SGD run can touch the target early by luck; the mean cannot.

    lab = compare(make_problem(256, 0.5, seed=0), lr=0.02, batch=16, steps=400, repeats=64, seed=0)
    lab.methods[0].steps_to(lab.target)   # GD's steps to the target loss
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

TRUE_W, TRUE_B = 2.0, -1.0  # the line the data are drawn around
START = (-1.0, 3.0)  # (w, b): far from the optimum, so that the paths show
MARGIN = 0.05  # the default target: 5% above the least loss L*
LINE = f"y = {TRUE_W:g}x - {-TRUE_B:g}"


@dataclass(frozen=True)
class Problem:
    """The data (x, y: (N,)) and what least squares knows of them: the optimum and its loss."""

    x: np.ndarray
    y: np.ndarray
    w_star: float
    b_star: float
    loss_star: float

    def loss(self, w: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
        """Mean squared error on all the data at (w, b), elementwise: exact, as a quadratic in (w, b)."""
        x, y = self.x, self.y
        return (w * w * np.mean(x * x) + 2 * w * b * np.mean(x) + b * b - 2 * w * np.mean(x * y)
                - 2 * b * np.mean(y) + np.mean(y * y))


def make_problem(samples: int, noise: float, seed: int) -> Problem:
    """``samples`` points x ~ N(0, 1), y = 2x - 1 + N(0, noise^2), seeded; (w*, b*) by least squares."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, samples)
    y = TRUE_W * x + TRUE_B + rng.normal(0.0, noise, samples)
    design = np.stack([x, np.ones_like(x)], axis=1)  # (N, 2)
    (w_star, b_star), *_ = np.linalg.lstsq(design, y, rcond=None)
    loss_star = float(np.mean((w_star * x + b_star - y) ** 2))
    return Problem(x, y, float(w_star), float(b_star), loss_star)


@dataclass(frozen=True)
class Descent:
    """One method's runs: the iterates and full-data loss after every step, (steps + 1, repeats) each."""

    name: str
    batch: int
    w: np.ndarray
    b: np.ndarray
    loss: np.ndarray

    @property
    def mean_loss(self) -> np.ndarray:
        """The loss averaged over the repeats (the expected loss), (steps + 1,)."""
        return self.loss.mean(axis=1)

    def steps_to(self, target: float) -> int | None:
        """The first step at which the mean loss is at or below ``target`` (None: not within the run)."""
        hit = np.flatnonzero(self.mean_loss <= target)
        return int(hit[0]) if hit.size else None

    def last_epoch_mean(self, samples: int) -> tuple[float, float]:
        """Run 0's (w, b) averaged over its last epoch of steps (iterate averaging)."""
        span = min(max(samples // self.batch, 1), len(self.w) - 1)
        return float(self.w[-span:, 0].mean()), float(self.b[-span:, 0].mean())

    def settled(self, floor: float) -> bool:
        """Its mean excess loss over L* has stopped falling: over the last quarter of the run, the second half
        is above 0.7 x the first (GD, converging geometrically, never is; a method in its noise ball is)."""
        quarter = (len(self.mean_loss) - 1) // 4
        if quarter < 2:
            return False
        first, second = np.split(self.mean_loss[-2 * (quarter // 2):] - floor, 2)
        return bool(second.mean() > 0.7 * first.mean())

    @property
    def diverged(self) -> bool:
        """Ended above where it started (or beyond floats): the lr is past this batch's stability limit."""
        last = self.loss[-1]
        return not bool(np.all(np.isfinite(last))) or float(last.mean()) > float(self.loss[0].mean())


def descend(problem: Problem, *, name: str, lr: float, batch: int, steps: int, repeats: int,
            seed: int) -> Descent:
    """Plain gradient steps of ``lr`` on batches of ``batch`` samples drawn without replacement (a fresh
    shuffle every epoch, the ragged tail of an epoch dropped), ``repeats`` independent shuffles at once."""
    rng = np.random.default_rng(seed)
    n = len(problem.x)
    per_epoch = n // batch
    w = np.full(repeats, START[0])
    b = np.full(repeats, START[1])
    ws, bs = np.empty((steps + 1, repeats)), np.empty((steps + 1, repeats))
    ws[0], bs[0] = w, b
    order = np.empty((repeats, n), dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):  # a too-large lr diverges; the table says so
        for t in range(steps):
            if t % per_epoch == 0:
                order = np.argsort(rng.random((repeats, n)), axis=1)  # one permutation per repeat
            idx = order[:, (t % per_epoch) * batch:(t % per_epoch + 1) * batch]  # (R, B)
            x, y = problem.x[idx], problem.y[idx]
            err = w[:, None] * x + b[:, None] - y  # (R, B)
            w = w - lr * 2 * (err * x).mean(axis=1)
            b = b - lr * 2 * err.mean(axis=1)
            ws[t + 1], bs[t + 1] = w, b
        loss = problem.loss(ws, bs)
    return Descent(name, batch, ws, bs, np.where(np.isfinite(loss), loss, np.inf))


@dataclass(frozen=True)
class Lab:
    problem: Problem
    lr: float
    target: float
    repeats: int
    methods: list[Descent]  # GD, mini-batch, SGD


def default_target(problem: Problem) -> float:
    return problem.loss_star * (1 + MARGIN)


def compare(problem: Problem, *, lr: float, batch: int, steps: int, repeats: int, seed: int,
            target: float | None = None) -> Lab:
    """GD, mini-batch SGD (``batch``) and SGD from one start with one lr; GD has no randomness (one run)."""
    n = len(problem.x)
    kinds = [("GD", n, 1), ("mini-batch", batch, repeats), ("SGD", 1, repeats)]
    methods = [descend(problem, name=name, lr=lr, batch=size, steps=steps, repeats=r, seed=seed + 1 + i)
               for i, (name, size, r) in enumerate(kinds)]
    return Lab(problem, lr, default_target(problem) if target is None else target, repeats, methods)


# ------------------------------------------------------------------------------------------- reading


def gd_limit(problem: Problem) -> float:
    """The largest lr at which GD converges: 2 / the largest eigenvalue of the Hessian 2 E[z z^T], with
    z = (x, 1)."""
    x = problem.x
    hessian = 2 * np.array([[np.mean(x * x), np.mean(x)], [np.mean(x), 1.0]])
    return 2 / float(np.linalg.eigvalsh(hessian)[-1])


def noise_ball(problem: Problem, lr: float, batch: int) -> float:
    """Theory's excess loss where SGD settles at a fixed lr, for samples drawn with replacement:
    lr * sigma^2 * (E[x^2] + 1) / batch (the stationary covariance of the iterates is lr sigma^2 / B times the
    identity when the Hessian is 2 E[z z^T], z = (x, 1)). Drawing without replacement settles lower."""
    return lr * problem.loss_star * (float(np.mean(problem.x ** 2)) + 1) / batch


def measured_ball(method: Descent, problem: Problem) -> float:
    """The excess loss over the last epoch of steps, averaged over them and the repeats."""
    span = min(max(len(problem.x) // method.batch, 1), len(method.loss) - 1)
    return float(method.loss[-span:].mean() - problem.loss_star)


def method_numbers(lab: Lab, m: Descent) -> dict[str, Any]:
    """What lab.json keeps of one method: its steps and samples to the target, where it ended, its curves
    (a number a diverged run made infinite is None there: JSON has no inf)."""
    p = lab.problem
    steps = m.steps_to(lab.target)
    w_avg, b_avg = m.last_epoch_mean(len(p.x))
    w_end, b_end = float(m.w[-1, 0]), float(m.b[-1, 0])
    measured = {"final": [w_end, b_end], "final_distance": math.hypot(w_end - p.w_star, b_end - p.b_star),
                "last_epoch_mean": [w_avg, b_avg],
                "last_epoch_mean_distance": math.hypot(w_avg - p.w_star, b_avg - p.b_star),
                "excess_loss_last_epoch": measured_ball(m, p)}
    return {"name": m.name, "batch": m.batch, "diverged": m.diverged, "steps_to_target": steps,
            "samples_to_target": None if steps is None else steps * m.batch,
            **{k: _listed(np.array(v)) if isinstance(v, list) else _listed(np.array([v]))[0]
               for k, v in measured.items()},
            "noise_ball_theory": noise_ball(p, lab.lr, m.batch), "settled": m.settled(p.loss_star),
            "loss_mean": _listed(m.mean_loss), "loss_run0": _listed(m.loss[:, 0]),
            "path": [_listed(m.w[:, 0]), _listed(m.b[:, 0])]}


def _listed(values: np.ndarray) -> list[float | None]:
    """A curve for lab.json: None where a diverged run left floats behind (JSON has no inf or nan)."""
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


def numbers(lab: Lab, settings: dict[str, Any]) -> dict[str, Any]:
    p = lab.problem
    return {"settings": settings, "optimum": {"w": p.w_star, "b": p.b_star, "loss": p.loss_star},
            "true_line": {"w": TRUE_W, "b": TRUE_B}, "start": list(START), "target": lab.target,
            "methods": [method_numbers(lab, m) for m in lab.methods]}


def shown(value: float | None, spec: str = ".3f") -> str:
    """A number of lab.json as the tables show it: None is what a diverged run left beyond floats."""
    return "inf" if value is None else f"{value:{spec}}"


def _count(value: int | None, unit: str) -> str:
    return f"{value:,} {unit}" if value is not None else "not reached"


def _ordered(names: list[str], values: list[int | None]) -> str:
    """'A 3 < B 7 = C 7' in increasing order, then the methods that never got there."""
    pairs = sorted((v, name) for v, name in zip(values, names) if v is not None)
    text = " ".join(f"{'' if i == 0 else ('= ' if v == pairs[i - 1][0] else '< ')}{name} {v:,}"
                    for i, (v, name) in enumerate(pairs))
    missing = [name for v, name in zip(values, names) if v is None]
    return "; ".join(filter(None, [text, f"not reached: {', '.join(missing)}" if missing else ""]))


def _in_order(values: list[int | None]) -> bool:
    """Non-decreasing, every method reached."""
    reached = [v for v in values if v is not None]
    return len(reached) == len(values) and all(a <= b for a, b in itertools.pairwise(reached))


def _per_step(ms: list[dict[str, Any]]) -> str:
    """What the steps say: more noise, more steps; and the mini-batch against GD (at one lr, ties are the rule
    once the batch's noise, B times below SGD's, is too small to matter at the target)."""
    gd, mb, sgd = ms
    if not _in_order([gd["steps_to_target"], mb["steps_to_target"], sgd["steps_to_target"]]):
        return ""
    said = " The noisier the gradient, the more steps."
    extra = mb["steps_to_target"] / gd["steps_to_target"] - 1
    if extra <= 0.1:
        share = "all" if extra <= 0 else "nearly all"
        return said + (f" At one lr, a batch of {mb['batch']} already makes {share} of a full batch's "
                       "progress per step: its noise is too small to matter at this target.")
    return said + (f" The batch of {mb['batch']} needs {extra:.0%} more steps than GD: its noise still "
                   "matters.")


def _per_sample(ms: list[dict[str, Any]]) -> str:
    reached = [m for m in ms if m["samples_to_target"] is not None]
    if not reached:
        return ""
    best = min(reached, key=lambda m: m["samples_to_target"])
    gd = ms[0]
    why = f"; GD reads all {gd['batch']} samples for each of its steps" if best is not gd else ""
    return f" Per sample seen, {best['name']} (batch {best['batch']}) learns the most{why}."


def _not_reached(m: dict[str, Any], lab: Lab) -> str:
    """Why a method missed the target, and the fix: more steps, unless it settled in a noise ball above
    the target."""
    steps, ball = len(m["loss_mean"]) - 1, m["excess_loss_last_epoch"]
    margin = lab.target - lab.problem.loss_star
    if not m["settled"] or ball < margin:
        return (f"{m['name']} did not reach the target in {steps} steps, and was still descending; fix: more "
                "--steps.")
    return (f"{m['name']} did not reach the target: its noise ball (excess loss {ball:.4f} over its last "
            f"epoch) is above the target's {margin:.4f} over L*, so more steps will not help; fix: a smaller "
            f"--lr, or --target {lab.problem.loss_star + 2 * ball:.4f}.")


def _settle(ms: list[dict[str, Any]]) -> str:
    """Where SGD ended at a fixed lr: in a noise ball, measured, against theory's."""
    gd, mb, sgd = ms
    return (f"At a fixed lr SGD does not settle: its last iterate is {sgd['final_distance']:.3f} from the "
            f"optimum (mini-batch {mb['final_distance']:.3f}, GD {gd['final_distance']:.1e}); averaged "
            f"over its last epoch it is {sgd['last_epoch_mean_distance']:.3f}. Its excess loss over that "
            f"epoch, {sgd['excess_loss_last_epoch']:.4f}, is its noise ball (theory, drawing with "
            f"replacement: lr x L* x (E[x^2] + 1) / batch = {sgd['noise_ball_theory']:.4f}); a smaller lr "
            "or a larger batch shrinks it.")


def reading(lab: Lab, nums: dict[str, Any]) -> list[str]:
    """Sentences a reader can act on, from the measured numbers (nothing claimed that was not measured)."""
    p, ms = lab.problem, nums["methods"]
    sgd = ms[2]
    names = [m["name"] for m in ms]
    setting = (f"Least squares on {len(p.x)} points around {LINE}: the optimum is w* = {p.w_star:.3f}, b* = "
               f"{p.b_star:.3f} with loss L* = {p.loss_star:.4f}; the target is {lab.target:.4f} "
               f"({lab.target / p.loss_star - 1:+.1%} of L*), all at lr {lab.lr:g} from (w, b) = {START}.")
    steps = (f"Steps to the target (stochastic methods: the loss averaged over {lab.repeats} shuffles): "
             f"{_ordered(names, [m['steps_to_target'] for m in ms])}." + _per_step(ms))
    samples = (f"Samples to the target: {_ordered(names, [m['samples_to_target'] for m in ms])}."
               + _per_sample(ms))
    said = [setting, steps, samples] + ([_settle(ms)] if sgd["settled"] and not sgd["diverged"] else [])
    for m in ms:
        if m["diverged"]:
            said.append(f"{m['name']} diverged: lr {lab.lr:g} is beyond what batches of {m['batch']} "
                        f"tolerate (GD's limit is 2 / the loss's largest curvature = {gd_limit(p):.3f}; a "
                        "small batch's curvature can be far above the average's); fix: a smaller --lr, e.g. "
                        "--lr 0.02.")
        elif m["steps_to_target"] is None:
            said.append(_not_reached(m, lab))
    return said


def rows(lab: Lab, nums: dict[str, Any]) -> list[tuple[str, str]]:
    p = lab.problem
    out = [("optimum (least squares)", f"w* {p.w_star:.4f}, b* {p.b_star:.4f}, L* {p.loss_star:.4f}"),
           ("target loss", f"{lab.target:.4f}")]
    for m in nums["methods"]:
        w, b = m["final"]
        head = f"{m['name']} (batch {m['batch']})"
        reach = f"{_count(m['steps_to_target'], 'steps')}, {_count(m['samples_to_target'], 'samples')}"
        ends = (f"w {shown(w)}, b {shown(b)}: {shown(m['final_distance'])} from the optimum "
                f"({shown(m['last_epoch_mean_distance'])} for its last epoch's mean)")
        out += [(f"{head}: to target", reach), (f"{head}: ends at", ends)]
    return out


# ------------------------------------------------------------------------------------------- figures

_COLORS = {"GD": "#1f77b4", "SGD": "#d62728"}
_MINI = "#2ca02c"


def _color(name: str) -> str:
    return _COLORS.get(name, _MINI)


def loss_figure(lab: Lab, *, per_sample: bool) -> Any:
    """Excess loss L - L* (log scale) against steps, or against samples seen (log-log): each method's mean
    over the shuffles (solid) and its run 0 (thin); the target as a dashed line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    floor = lab.problem.loss_star
    cap = 1e4 * float(lab.methods[0].loss[0, 0])  # a diverging method is drawn until it leaves the plot
    for m in lab.methods:
        x = np.arange(len(m.mean_loss)) * (m.batch if per_sample else 1)
        if per_sample:
            x = x[1:]  # samples seen start at one batch (a log axis has no 0)
        start = 1 if per_sample else 0
        one, mean = (np.where(v[start:] < cap, v[start:] - floor, np.nan)
                     for v in (m.loss[:, 0], m.mean_loss))
        if m.loss.shape[1] > 1:
            ax.plot(x, one, color=_color(m.name), lw=0.6, alpha=0.45)
        ax.plot(x, mean, color=_color(m.name), lw=1.8, label=f"{m.name} (batch {m.batch})")
    ax.axhline(lab.target - floor, color="gray", ls="--", lw=1, label="target")
    ax.set_yscale("log")
    ax.set_ylim(bottom=(lab.target - floor) * 1e-4)  # below: GD's rounding error, not learning
    if per_sample:
        ax.set_xscale("log")
    ax.set_xlabel("samples seen" if per_sample else "step")
    ax.set_ylabel("excess loss  L - L*")
    ax.set_title(f"Loss vs {'samples seen' if per_sample else 'steps'} at lr {lab.lr:g} (thick: mean of "
                 f"{lab.repeats} shuffles, thin: one run)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def paths_figure(lab: Lab) -> Any:
    """Run 0's (w, b) path of each method over the contours of the loss, the optimum marked."""
    from matplotlib.figure import Figure

    p = lab.problem
    finite = [m for m in lab.methods if not m.diverged]
    ws = np.concatenate([m.w[:, 0] for m in finite] + [[p.w_star]])
    bs = np.concatenate([m.b[:, 0] for m in finite] + [[p.b_star]])
    pad_w, pad_b = 0.15 * (np.ptp(ws) + 0.1), 0.15 * (np.ptp(bs) + 0.1)
    gw, gb = np.meshgrid(np.linspace(ws.min() - pad_w, ws.max() + pad_w, 200),
                         np.linspace(bs.min() - pad_b, bs.max() + pad_b, 200))
    surface = p.loss(gw, gb) - p.loss_star
    fig = Figure(figsize=(6.5, 5.5), layout="constrained")
    ax = fig.add_subplot()
    levels = np.geomspace(max(surface.min(), 1e-4 * surface.max(), 1e-6), surface.max(), 14)
    ax.contour(gw, gb, surface, levels=levels, colors="#bbbbbb", linewidths=0.8)
    for m in finite:
        ax.plot(m.w[:, 0], m.b[:, 0], color=_color(m.name), lw=1.0, marker=".", ms=2.5,
                label=f"{m.name} ({len(m.w) - 1} steps)")
    ax.plot(*START, "ko", ms=6, label="start")
    ax.plot(p.w_star, p.b_star, marker="*", color="gold", mec="black", ms=16, ls="", label="optimum (w*, b*)")
    ax.set_xlabel("w")
    ax.set_ylabel("b")
    ax.set_title("Paths over the loss contours (log-spaced levels of L - L*)")
    ax.legend(loc="best", fontsize=8)
    return fig
