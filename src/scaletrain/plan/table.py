"""The data-parallel plan as a table (memory per GPU and time per step, a column per layout) with the lines around
it: what `scaletrain plan` prints for a recipe, and scaletrain.plan_fit() for a model of one's own.

The output fits 80 columns, on a terminal or in a pipe alike: a column per layout (at most six: DDP, FSDP and
HSDP, each without and with checkpointing), a row per quantity, so the layouts compare along a row; prose
wraps between words. ``width`` None (--wide) prints a row per layout and a column per quantity instead.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from scaletrain.plan.actual import Calibration
    from scaletrain.plan.estimate import Layout, Plan

WIDTH = 80  # columns of the default output
MEMORY = ("params", "grads", "optimizer", "activations", "fsdp buffers", "total")
TIME = ("compute", "comm", "step", "run", "cost $")
WIDE_COLUMNS = ("layout", "checkpointing", *MEMORY, "fits", "compute", "comm", "run", "cost $")
CAPTION = ("compute: model FLOPs / (GPUs x peak x MFU), MFU x 3/4 with full checkpointing (the GPU also "
           "recomputes a forward); comm: ring collectives at the link rate, a lower bound; step = max(compute, comm) "
           "(docs/plan.md)")


def dollars(cost: float) -> str:
    """Cents below $10k, then whole dollars, then millions: at most 9 characters below $10 billion."""
    if cost < 10_000:
        return f"{cost:,.2f}"
    return f"{cost:,.0f}" if cost < 1e6 else f"{cost / 1e6:,.1f}M"


def size(n: float) -> str:
    """fmt_bytes, but terabytes from 1 TB on (a 70B model's DDP replica), so a cell stays within 9 characters."""
    from scaletrain.observe.memory import fmt_bytes

    return f"{n / 1e12:.2f} TB" if n >= 999.995e9 else fmt_bytes(n)  # not "1000.00 GB"


def _cells(plan: Plan, lay: Layout) -> dict[str, str]:
    """One layout's numbers as both tables print them, by quantity."""
    from scaletrain.plan.estimate import fmt_seconds

    sizes = (lay.params_bytes, lay.grads_bytes, lay.optim_bytes, lay.activations_bytes, lay.fsdp_buffers_bytes,
             lay.total_bytes)
    cost = plan.cost(lay)
    return {"layout": lay.strategy, "checkpointing": lay.checkpointing,
            **{name: size(b) for name, b in zip(MEMORY, sizes)}, "fits": "yes" if lay.fits else "NO",
            "compute": fmt_seconds(lay.compute_s), "comm": fmt_seconds(lay.comm_s), "step": fmt_seconds(lay.step_s),
            "run": fmt_seconds(plan.run_hours(lay) * 3600), "cost $": "-" if cost is None else dollars(cost)}


def _by_layout(plan: Plan) -> Table:
    """A column per layout, a row per quantity; no vertical rules and two spaces between columns, so six layouts
    of 9-character cells fit in 80 columns."""
    table = Table("layout\ncheckpointing", box=box.HORIZONTALS, show_edge=False, pad_edge=False,
                  padding=(0, 0, 0, 1))
    cells = [_cells(plan, lay) for lay in plan.layouts]
    for lay in plan.layouts:
        table.add_column(f"{lay.strategy}\n{lay.checkpointing}", justify="right")
    for name in (*MEMORY, "fits", *TIME):
        table.add_row(name, *(c[name] for c in cells), end_section=name == "fits")
    return table


def _by_quantity(plan: Plan) -> Table:
    """--wide: a row per layout, a column per quantity (the table before 80 columns were the default)."""
    table = Table(box=box.HEAVY_HEAD)
    for i, name in enumerate(WIDE_COLUMNS):
        table.add_column(name, justify="left" if i == 0 else "right")
    for lay in plan.layouts:
        cells = _cells(plan, lay)
        table.add_row(*(cells[name] for name in WIDE_COLUMNS))
    return table


def say(text: str, width: int | None) -> None:
    """A line of prose, wrapped between words to ``width`` columns (None: one line), continuations indented."""
    print(text if width is None else textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False))


def show(table: Table, width: int | None) -> None:
    """The table at a width set here, not by the terminal: the same output on a terminal and in a pipe."""
    if width is None:  # --wide: exactly as wide as the table needs
        width = Console(width=10_000).measure(table).maximum
    Console(highlight=False, width=width).print(table)


def print_plan(name: str, plan: Plan, batch: str, width: int | None, calibration: Calibration | None = None,
                mfu_source: str = "", given: float | None = None) -> None:
    """The plan of config ``name`` in ``width`` columns (None: --wide, a line per sentence); ``batch`` as
    train.batching describes it."""
    from scaletrain.observe.memory import fmt_bytes
    from scaletrain.observe.peaks import compute_format

    acc, facts = plan.accelerator, plan.facts
    per = f" ({facts.tokens_per_sample} tokens each)" if facts.tokens_per_sample else ""
    assumed = (f"MFU {given:g} given (its own layout, whole steps)" if given is not None else
               f"MFU {plan.mfu:g} assumed ({0.75 * plan.mfu:g} with full checkpointing)")
    say(f"plan: {name} on {plan.nodes} x {plan.gpus_per_node} {acc.key}, {plan.total_steps} steps, {assumed}",
         width)
    if calibration is not None:
        say(calibration.describe(), width)
    elif mfu_source:
        say(f"MFU: {mfu_source}", width)
    say(f"{acc.key}: {acc.name}, {acc.memory_bytes / 2**30:.1f} GiB, {plan.peak / 1e12:.0f} TFLOP/s "
         f"{compute_format(plan.precision, tf32=plan.tf32)}", width)
    say(f"model: {facts.params / 1e6:.1f}M parameters, {facts.flops_per_sample / 1e9:.3g} GFLOP per sample{per}",
         width)
    say(batch, width)
    say(f"memory per GPU (fits: within {fmt_bytes(plan.usable_bytes)}, 80%) and time per step", width)
    show(_by_layout(plan) if width else _by_quantity(plan), width)
    say(CAPTION, width)
    verdict = f"use {plan.choice.strategy}" if plan.choice else "no layout fits"
    say(f"plan: {verdict}: {plan.reason}", width)
