"""The report's charts: each function takes parsed runs and returns a Chart holding the figure it drew and
the numbers it drew (``data``), so that tests and report.json can read exactly what the picture shows.

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``), never pyplot: no global
figure registry and no display backend, so the report renders the same on a headless machine.
A chart whose keys no run has is returned with ``figure=None`` and a ``note`` saying what is missing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scaletrain.observe.report.load import Run
from scaletrain.observe.report.lr import planned_lr

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn: the trainer reads this package's loader only
    from matplotlib.figure import Figure

# Phases that add up to the step (docs/metrics.md); "step" and "pre_comm" are drawn apart from the stack.
STACKED_PHASES = ("data", "h2d", "compute", "comm", "optim", "ckpt")
_PHASE_COLORS = {"data": "#e69f00", "h2d": "#56b4e9", "compute": "#009e73", "comm": "#d55e00",
                 "optim": "#cc79a7", "ckpt": "#999999"}
_RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_MIB = 2**20
CHART_NAMES = ("loss", "lr", "throughput", "phases", "stragglers", "memory", "noise_scale")  # also the PNG stems


@dataclass
class Chart:
    name: str  # file stem: "loss" -> loss.png
    title: str
    caption: str  # how to read it
    data: dict[str, Any] = field(default_factory=dict)  # what was drawn, by legend label
    figure: Figure | None = None  # None: omitted, and `note` says why
    note: str = ""  # why the chart (or one run's part of it) is missing


@dataclass(frozen=True)
class XAxis:
    label: str
    of: Callable[[Run, int], float]  # (run, step) -> x value


def x_axis(runs: list[Run]) -> XAxis:
    """Steps, unless the runs compared took steps of different sizes (1 vs 2 ranks at a fixed per-rank
    batch): then samples seen, so that the same x means the same amount of training in every run."""
    batches = {r.global_batch for r in runs}
    if len(runs) > 1 and None not in batches and len(batches) > 1:
        return XAxis("samples seen (runs differ in global batch)", lambda run, step: step * run.global_batch)
    return XAxis("optimizer step", lambda run, step: float(step))


def _color(i: int) -> str:
    return _RUN_COLORS[i % len(_RUN_COLORS)]


def _figure(panels: int = 1, width: float = 8.0, height: float = 4.2) -> tuple[Figure, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * panels), dpi=100, layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _missing(runs: list[Run], have: list[Run], what: str) -> str:
    lacking = [r.name for r in runs if r not in have]
    return f"{', '.join(lacking)}: no {what} in metrics.jsonl" if lacking else ""


def _series(run: Run, records: list[dict[str, Any]], key: str, ax: XAxis) -> dict[str, list[float]]:
    rows = [r for r in records if key in r]
    return {"x": [ax.of(run, r["step"]) for r in rows], "y": [float(r[key]) for r in rows]}


def _style(suffix: str, points: int) -> dict[str, Any]:
    """Eval dashed; per-rank lines thin and dotted under the run's main line; a planned curve (the lr
    schedule) a plain line, and the values the run logged over it as dots: the plan and the measurement."""
    if suffix == "logged":
        return {"linestyle": "none", "marker": "o", "markersize": 4, "zorder": 3}
    if suffix.startswith("rank"):
        return {"linestyle": ":", "linewidth": 1.0}
    dots = points < 30 and suffix != "schedule"
    return {"linestyle": "--" if "eval" in suffix or suffix == "global batch" else "-", "linewidth": 1.5, "markersize": 3,
            "marker": "o" if dots else None}


def _line_chart(runs: list[Run], ax_x: XAxis, *, name: str, title: str, caption: str, panels: list[
        tuple[str, str, str, Callable[[Run], dict[str, dict[str, list[float]]]]]]) -> Chart:
    """One figure, a panel per (ylabel, scale, what-is-missing, run -> {suffix: series}), a line per series."""
    chart = Chart(name, title, caption)
    live = []
    for panel in panels:
        got = {run.name: panel[3](run) for run in runs}
        if any(s["x"] for series in got.values() for s in series.values()):
            live.append((panel, got))
    if not live:
        chart.note = f"omitted: no run has {' or '.join(p[2] for p in panels)} in metrics.jsonl"
        return chart
    fig, axes = _figure(len(live))
    notes = []
    for axis, ((ylabel, scale, what, _), got) in zip(axes, live):
        have, drawn = [], []
        for i, run in enumerate(runs):
            for suffix, s in got[run.name].items():
                if not s["x"]:
                    continue
                label = f"{run.name} {suffix}".strip()
                axis.plot(s["x"], s["y"], color=_color(i), label=label, **_style(suffix, len(s["x"])))
                chart.data[label] = s
                drawn.extend(s["y"])
                if run not in have:
                    have.append(run)
        axis.set_ylabel(ylabel)
        # A log axis cannot show a zero or negative value (a user's loss may be either).
        # Log only where it helps read the curve: a loss falling over a decade or more. (A log axis cannot
        # show zero or a negative value either; a user's loss may be both.)
        finite = [y for y in drawn if math.isfinite(y)]
        spread = scale == "log" and finite and min(finite) > 0 and max(finite) / min(finite) >= 10
        axis.set_yscale("log" if spread else "linear")
        axis.legend(fontsize="small")
        if note := _missing(runs, have, what):
            notes.append(note)
    axes[-1].set_xlabel(ax_x.label)
    axes[0].set_title(title)
    chart.figure, chart.note = fig, "; ".join(notes)
    return chart


def loss_chart(runs: list[Run], ax: XAxis) -> Chart:
    def loss(run: Run) -> dict[str, dict[str, list[float]]]:
        return {"train": _series(run, run.train, "loss", ax), "eval": _series(run, run.eval, "eval_loss", ax)}

    def accuracy(run: Run) -> dict[str, dict[str, list[float]]]:
        return {"eval accuracy": _series(run, run.eval, "eval_accuracy", ax)}

    return _line_chart(runs, ax, name="loss", title="Loss (train: solid, eval: dashed) and eval accuracy",
                       caption="Training loss is the mean over each log interval and all ranks; eval loss and "
                       "accuracy are exact over the whole held-out set. Eval above train and rising: overfitting.",
                       panels=[("loss", "log", "loss", loss), ("eval accuracy", "linear", "eval_accuracy", accuracy)])


def lr_chart(runs: list[Run], ax: XAxis) -> Chart:
    plans = {run.name: planned_lr(run) for run in runs}

    def lr(run: Run) -> dict[str, dict[str, list[float]]]:
        logged = _series(run, run.train, "lr", ax)
        steps, values, _ = plans[run.name]
        if not steps:
            return {"": logged}
        return {"schedule": {"x": [ax.of(run, s) for s in steps], "y": values}, "logged": logged}

    chart = _line_chart(runs, ax, name="lr", title="Learning rate (line: the schedule; dots: logged)",
                        caption="The line is the lr of every step, computed from the run's config.toml and "
                        "summary.json by the trainer's own schedule code: warmup, then the decay. The dots "
                        "are the lr the run logged after each log interval, which should sit on it. With "
                        "--optim.scale_lr the peak grows with the global batch (linear scaling rule).",
                        panels=[("learning rate", "linear", "lr", lr)])
    if chart.figure is not None:
        missing = [f"{name}: the schedule is not redrawn ({why}); the line joins the logged points"
                   for name, (_, _, why) in plans.items() if why]
        chart.note = "; ".join(n for n in [chart.note, *missing] if n)
    return chart


def _per_rank(run: Run) -> dict[str, list[float]]:
    rows = [r for r in run.train if "samples_per_s" in r]
    world = run.world_size
    if all("samples_per_s_per_rank" in r for r in rows):
        y = [float(r["samples_per_s_per_rank"]) for r in rows]
    elif world:
        y = [float(r["samples_per_s"]) / world for r in rows]
    else:
        return {"x": [], "y": []}
    return {"x": [float(r["step"]) for r in rows], "y": y}


def throughput_chart(runs: list[Run], ax: XAxis) -> Chart:
    def per_rank(run: Run) -> dict[str, dict[str, list[float]]]:
        s = _per_rank(run)
        return {"per rank": {"x": [ax.of(run, int(x)) for x in s["x"]], "y": s["y"]}}

    return _line_chart(
        runs, ax, name="throughput", title="Throughput (training samples per second; eval excluded)",
        caption="Top: global samples/s. Bottom: per rank. Perfect scaling keeps the per-rank line flat as ranks "
        "are added; the drop is what communication and waiting cost.",
        panels=[("samples/s (global)", "linear", "samples_per_s",
                 lambda run: {"": _series(run, run.train, "samples_per_s", ax)}),
                ("samples/s per rank", "linear", "samples_per_s", per_rank)])


def _interval_weights(records: list[dict[str, Any]]) -> list[int]:
    """Steps in each log interval (the last interval of a run is often shorter)."""
    weights, prev = [], 0
    for r in records:
        weights.append(max(1, r["step"] - prev))
        prev = r["step"]
    return weights


def mean_phase_times(run: Run) -> dict[str, list[float]]:
    """{phase: [seconds per step for rank 0, 1, ...]} over the whole run, intervals weighted by their steps."""
    rows = [r for r in run.train if r.get("phase_s")]
    weights = _interval_weights(rows)
    total = sum(weights)
    out: dict[str, list[float]] = {}
    for phase in {p for r in rows for p in r["phase_s"]}:
        have = [(w, r["phase_s"][phase]) for w, r in zip(weights, rows) if phase in r["phase_s"]]
        ranks = len(have[0][1])
        weight = sum(w for w, _ in have) or total
        out[phase] = [sum(w * v[k] for w, v in have) / weight for k in range(ranks)]
    return out


def phases_chart(runs: list[Run]) -> Chart:
    chart = Chart("phases", "Per-rank phase times (mean seconds per optimizer step)",
                  "One bar per rank: where its step time goes. The black tick is the measured step; the bar "
                  "(the phases) should reach it. A rank whose data or compute bar is longer than the others' "
                  "is the straggler; the others show it as a longer comm bar (they wait for it in the all-reduce).")
    have = [r for r in runs if any(rec.get("phase_s") for rec in r.train)]
    if not have:
        chart.note = "omitted: no run has phase_s in metrics.jsonl (per-rank phase times are recorded by " \
                     "scaletrain runs from issue 5 on)"
        return chart
    bars: list[tuple[str, int, dict[str, float]]] = []  # (label, run index, {phase: s})
    for i, run in enumerate(runs):
        if run not in have:
            continue
        means = mean_phase_times(run)
        for rank in range(len(next(iter(means.values())))):
            label = f"{run.name} r{rank}" if len(have) > 1 else f"rank {rank}"
            bars.append((label, i, {p: v[rank] for p, v in means.items()}))
            chart.data[f"{run.name} rank {rank}"] = {p: v[rank] for p, v in means.items()}
    fig, (ax,) = _figure(width=max(6.0, 1.0 + 0.55 * len(bars)))
    xs = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for phase in STACKED_PHASES:
        heights = [b[2].get(phase, 0.0) for b in bars]
        if any(heights):
            ax.bar(xs, heights, bottom=bottom, color=_PHASE_COLORS[phase], label=phase, width=0.7)
            bottom = [b + h for b, h in zip(bottom, heights)]
    steps = [(x, b[2]["step"]) for x, b in zip(xs, bars) if "step" in b[2]]
    if steps:
        ax.scatter([x for x, _ in steps], [s for _, s in steps], marker="_", s=600, color="black", zorder=3,
                   label="step")
    ax.set_xticks(xs, [b[0] for b in bars], rotation=45 if len(bars) > 8 else 0, ha="right" if len(bars) > 8
                  else "center")
    for tick, (_, i, _) in zip(ax.get_xticklabels(), bars):
        tick.set_color(_color(i))
    ax.set_ylabel("seconds per step")
    ax.set_title(chart.title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    chart.figure, chart.note = fig, _missing(runs, have, "phase_s")
    return chart


def straggler_matrix(run: Run) -> dict[str, Any] | None:
    """rank x interval: each rank's time before the all-reduce relative to the median over ranks.

    pre_comm is the phase that tells a slow rank from ranks waiting for it (docs/metrics.md); with DDP every
    rank's `step` is equally long, so `step` is the fallback only for runs that lack pre_comm. +0.25 means
    25% slower than the median rank in that interval. None when the run has fewer than 2 ranks or no phases.
    """
    rows = [r for r in run.train if r.get("phase_s")]
    phase = "pre_comm" if any("pre_comm" in r["phase_s"] for r in rows) else "step"
    rows = [r for r in rows if phase in r["phase_s"]]
    if not rows or len(rows[0]["phase_s"][phase]) < 2:
        return None
    ranks = len(rows[0]["phase_s"][phase])
    relative = [[0.0] * len(rows) for _ in range(ranks)]
    for j, r in enumerate(rows):
        times = r["phase_s"][phase]
        median = statistics.median(times)
        for k in range(ranks):
            relative[k][j] = (times[k] - median) / median if median > 0 else 0.0
    flagged = [[r["step"], r["straggler"]["rank"]] for r in rows
               if isinstance(r.get("straggler"), dict) and isinstance(r["straggler"].get("rank"), int)]
    mean_by_rank = [sum(row) / len(row) for row in relative]
    return {"phase": phase, "steps": [r["step"] for r in rows], "ranks": list(range(ranks)),
            "relative": relative, "flagged": flagged,
            "slowest_rank": max(range(ranks), key=lambda k: mean_by_rank[k]), "mean_relative": mean_by_rank}


def straggler_chart(runs: list[Run]) -> Chart:
    chart = Chart("stragglers", "Straggler heatmap: each rank's time before the all-reduce vs the median rank",
                  "Rows are ranks, columns log intervals. Red: slower than the median rank in that interval "
                  "(+0.25 = 25% slower), blue: faster. A red row that persists is a straggler: every other rank "
                  "waits for it at each gradient all-reduce. x marks intervals where the trainer flagged one.")
    mats = {run.name: m for run in runs if (m := straggler_matrix(run)) is not None}
    if not mats:
        single = [r.name for r in runs if r.world_size == 1]
        why = "one rank only: nothing to compare" if len(single) == len(runs) else \
            "no run has per-rank phase_s (with 2+ ranks) in metrics.jsonl"
        chart.note = f"omitted: {why}"
        return chart
    fig, axes = _figure(len(mats), height=max(2.4, 1.2 + 0.3 * max(len(m["ranks"]) for m in mats.values())))
    for ax, (name, m) in zip(axes, mats.items()):
        values = m["relative"]
        limit = max(0.05, max(abs(v) for row in values for v in row))
        steps = m["steps"]
        image = ax.imshow(values, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest",
                          origin="lower")
        ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_yticks(m["ranks"], [f"rank {k}" for k in m["ranks"]])
        ax.grid(False)
        column = {step: j for j, step in enumerate(steps)}
        if m["flagged"]:
            ax.scatter([column[s] for s, _ in m["flagged"]], [r for _, r in m["flagged"]], marker="x",
                       color="black", s=30)
        ax.set_title(f"{name}: {m['phase']} vs median of ranks (slowest on average: rank {m['slowest_rank']})",
                     fontsize="medium")
        ax.set_xlabel("optimizer step (end of log interval)")
        fig.colorbar(image, ax=ax, label="relative to median")
        chart.data[name] = m
    chart.figure = fig
    lacking = [r.name for r in runs if r.name not in mats]
    chart.note = f"{', '.join(lacking)}: fewer than 2 ranks or no phase_s" if lacking else ""
    return chart


def memory_chart(runs: list[Run], ax_x: XAxis) -> Chart:
    def peaks(run: Run) -> dict[str, dict[str, list[float]]]:
        rows = [r for r in run.train if isinstance(r.get("mem"), dict)]
        out = {"peak (max over ranks)": {"x": [ax_x.of(run, r["step"]) for r in rows if "peak_bytes" in r["mem"]],
                                         "y": [r["mem"]["peak_bytes"] / _MIB for r in rows
                                               if "peak_bytes" in r["mem"]]}}
        ranked = [r for r in rows if "rank_peak_bytes" in r["mem"]]
        if ranked and len(ranked[0]["mem"]["rank_peak_bytes"]) > 1:
            for k in range(len(ranked[0]["mem"]["rank_peak_bytes"])):
                out[f"rank {k}"] = {"x": [ax_x.of(run, r["step"]) for r in ranked],
                                    "y": [r["mem"]["rank_peak_bytes"][k] / _MIB for r in ranked]}
        return out

    chart = _line_chart(runs, ax_x, name="memory", title="Peak memory (MiB; CUDA allocator peak on GPU, RSS on CPU)",
                        caption="The peak so far at each log interval. A rank far above the others holds more "
                        "(uneven batches, a rank doing extra work); a steady climb is a leak.",
                        panels=[("MiB", "linear", "mem", peaks)])
    if chart.figure is None:
        known = [f"{r.name} {r.summary['peak_mem_bytes'] / _MIB:,.0f} MiB" for r in runs
                 if r.summary and isinstance(r.summary.get("peak_mem_bytes"), (int, float))]
        chart.note = "omitted: no run has mem in metrics.jsonl" + (
            f" (summary.json's peak, in the table: {', '.join(known)})" if known else "")
    return chart


def noise_scale_chart(runs: list[Run], ax_x: XAxis) -> Chart:
    def b_simple(run: Run) -> dict[str, dict[str, list[float]]]:
        rows = [r for r in run.train if isinstance(r.get("grad_noise_scale"), dict)]
        return {"B_simple (smoothed)": {"x": [ax_x.of(run, r["step"]) for r in rows],
                                        "y": [r["grad_noise_scale"]["b_simple"] for r in rows]},
                "global batch": {"x": [ax_x.of(run, r["step"]) for r in rows],
                                 "y": [r["grad_noise_scale"]["b_big"] for r in rows]}}

    return _line_chart(runs, ax_x, name="noise_scale", title="Gradient noise scale B_simple (samples) and the batch",
                       caption="B_simple = tr(Sigma)/|G|^2 (McCandlish et al. 2018), from each rank's gradient "
                       "before the all-reduce and the averaged one after it: the critical batch to first order. "
                       "Below it, doubling the batch (the world size) nearly halves the steps to a given loss; "
                       "above it, more ranks buy little. It usually grows as the loss falls.",
                       panels=[("samples", "log", "grad_noise_scale", b_simple)])


def all_charts(runs: list[Run]) -> list[Chart]:
    ax = x_axis(runs)
    charts = [loss_chart(runs, ax), lr_chart(runs, ax), throughput_chart(runs, ax), phases_chart(runs),
              straggler_chart(runs), memory_chart(runs, ax)]
    if any(isinstance(r.get("grad_noise_scale"), dict) for run in runs for r in run.train):
        charts.append(noise_scale_chart(runs, ax))
    assert tuple(c.name for c in charts) == CHART_NAMES[:len(charts)]
    return charts
