"""`scaletrain plan RECIPE|FILE.toml --gpu KIND [--nproc N] [--nnodes M] [--price USD] [--section.key=value ...]`.

The output fits 80 columns, on a terminal or in a pipe alike: a column per layout (at most six: DDP, FSDP and
HSDP, each without and with checkpointing), a row per quantity, so the layouts compare along a row; prose
wraps between words. --wide prints a row per layout and a column per quantity instead (about 150 columns).
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from scaletrain.cli.options import add_config_argument, add_config_options, check_types, config_overrides
from scaletrain.config import load
from scaletrain.errors import UserError

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

HELP = ("Before a run: memory per GPU for DDP, FSDP and HSDP, with and without activation checkpointing, the "
        "time per step and of the run, its cost, and the layout to use. Nothing runs on a GPU: the model is "
        "built on fake tensors.")


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.plan.catalog import ACCELERATORS

    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain plan RECIPE|FILE.toml --gpu KIND [--nproc GPUS_PER_MACHINE] "
                             "[--nnodes MACHINES] [--price USD_PER_GPU_HOUR] [--calibrate RUN_DIR ...] "
                             "[--section.key=value ...]")
    add_config_argument(p)
    own = p.add_argument_group("plan")
    own.add_argument("--gpu", default="h100", help=f"the accelerator: {', '.join(ACCELERATORS)} [default: h100]")
    own.add_argument("--mfu", default=None, help="model FLOPs utilization to assume for a run without activation "
                     "checkpointing (full checkpointing's recompute makes it 3/4 of that), in (0, 1] [default: the "
                     "measured run nearest in size on this --gpu with this train.compile, plan/catalog.py "
                     "DEFAULT_MFU; 0.4 where none was measured]")
    own.add_argument("--calibrate", nargs="+", default=[], metavar="RUN_DIR",
                     help="take the MFU and an activations correction from runs made on this --gpu (their "
                     "summary.json plan vs actual) [default: none]")
    own.add_argument("--net-gbps", default="400", help="network between machines, Gb/s per GPU [default: 400]")
    own.add_argument("--price", default="", help="US dollars per GPU-hour, for the run's cost [default: none]")
    own.add_argument("--json", default="", help="also write the plan to this file")
    own.add_argument("--wide", action="store_true", help="one row per layout, one column per quantity, about 150 "
                     "columns wide [default: one column per layout, within 80 columns]")
    add_config_options(p)


def _number(flag: str, text: str, low: float, high: float, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low < value <= high:
        raise UserError(f"{flag} = {text!r}: expected a number in ({low:g}, {high:g}]; fix: {flag} {example}")
    return value


def _dollars(cost: float) -> str:
    """Cents below $10k, then whole dollars, then millions: at most 9 characters below $10 billion."""
    if cost < 10_000:
        return f"{cost:,.2f}"
    return f"{cost:,.0f}" if cost < 1e6 else f"{cost / 1e6:,.1f}M"


def _size(n: float) -> str:
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
            **{name: _size(b) for name, b in zip(MEMORY, sizes)}, "fits": "yes" if lay.fits else "NO",
            "compute": fmt_seconds(lay.compute_s), "comm": fmt_seconds(lay.comm_s), "step": fmt_seconds(lay.step_s),
            "run": fmt_seconds(plan.run_hours(lay) * 3600), "cost $": "-" if cost is None else _dollars(cost)}


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


def _say(text: str, width: int | None) -> None:
    """A line of prose, wrapped between words to ``width`` columns (None: one line), continuations indented."""
    print(text if width is None else textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False))


def _show(table: Table, width: int | None) -> None:
    """The table at a width set here, not by the terminal: the same output on a terminal and in a pipe."""
    if width is None:  # --wide: exactly as wide as the table needs
        width = Console(width=10_000).measure(table).maximum
    Console(highlight=False, width=width).print(table)


def _print_plan(name: str, plan: Plan, batch: str, width: int | None, calibration: Calibration | None = None,
                mfu_source: str = "") -> None:
    """The plan of config ``name`` in ``width`` columns (None: --wide, a line per sentence); ``batch`` as
    train.batching describes it."""
    from scaletrain.observe.memory import fmt_bytes
    from scaletrain.observe.peaks import compute_format

    acc, facts = plan.accelerator, plan.facts
    per = f" ({facts.tokens_per_sample} tokens each)" if facts.tokens_per_sample else ""
    _say(f"plan: {name} on {plan.nodes} x {plan.gpus_per_node} {acc.key}, {plan.total_steps} steps, "
         f"MFU {plan.mfu:g} assumed ({0.75 * plan.mfu:g} with full checkpointing)", width)
    if calibration is not None:
        _say(calibration.describe(), width)
    elif mfu_source:
        _say(f"MFU: {mfu_source}", width)
    _say(f"{acc.key}: {acc.name}, {acc.memory_bytes / 2**30:.1f} GiB, {plan.peak / 1e12:.0f} TFLOP/s "
         f"{compute_format(plan.precision, tf32=plan.tf32)}", width)
    _say(f"model: {facts.params / 1e6:.1f}M parameters, {facts.flops_per_sample / 1e9:.3g} GFLOP per sample{per}",
         width)
    _say(batch, width)
    _say(f"memory per GPU (fits: within {fmt_bytes(plan.usable_bytes)}, 80%) and time per step", width)
    _show(_by_layout(plan) if width else _by_quantity(plan), width)
    _say(CAPTION, width)
    verdict = f"use {plan.choice.strategy}" if plan.choice else "no layout fits"
    _say(f"plan: {verdict}: {plan.reason}", width)


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.plan.catalog import ACCELERATORS, default_mfu

    acc = ACCELERATORS.get(args.gpu.lower())
    if acc is None:
        raise UserError(f"--gpu = {args.gpu!r}: expected one of {', '.join(ACCELERATORS)}; fix: --gpu h100")
    mfu = _number("--mfu", args.mfu, 0.0, 1.0, "0.4") if args.mfu is not None else 0.0
    net = _number("--net-gbps", args.net_gbps, 0.0, 1e6, "400") * 1e9 / 8
    price = _number("--price", args.price, 0.0, 1e6, "2.5") if args.price else None
    calibration = None
    if args.calibrate:  # read before the model is measured: a run that cannot calibrate is said at once
        from scaletrain.plan.actual import calibrate

        calibration = calibrate(args.calibrate, acc.key)
        if calibration.mfu is None and calibration.activations is None:
            raise UserError(f"--calibrate {' '.join(args.calibrate)}: no MFU and no activations measured in these "
                            "runs; fix: calibrate with runs of a built-in model on this --gpu")
    from scaletrain.bench.report import check_output_path, write_json
    from scaletrain.data import build_splits
    from scaletrain.plan.estimate import make_plan, measure_model
    from scaletrain.train.batching import plan_batches

    check_output_path(args.json or None, "--json", ".json")
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    if overrides.get("dist.nnodes", "1") != "1":  # a plan needs no rendezvous; the run will
        overrides.setdefault("dist.rdzv_endpoint", "planned:29500")
    cfg = load(args.config, cli_overrides=overrides).for_device("cuda")  # a plan is for a GPU (--gpu)
    world = cfg.dist.nproc * cfg.dist.nnodes
    splits = build_splits(cfg.data, cfg.model)
    batches = plan_batches(cfg, world, len(splits.train))  # type: ignore[arg-type]
    sample = splits.train[0][0]
    facts = measure_model(cfg, splits.task, splits.info, sample, target=splits.train[0][1])
    source = "given (--mfu)"
    if args.mfu is None:
        mfu, source = default_mfu(acc.key, compiled=cfg.train.compile, params=facts.params)
    if calibration is not None:
        if calibration.mfu is not None and args.mfu is None:  # an explicit --mfu wins
            mfu, source = calibration.mfu, "the calibrating runs'"
        if calibration.activations is not None:
            facts = dataclasses.replace(facts, activations={k: round(v * calibration.activations)
                                                            for k, v in facts.activations.items()})
    plan = make_plan(cfg, facts, acc, total_steps=batches.total_steps, accum_steps=batches.accum_steps, mfu=mfu,
                     net_bytes_per_s=net, price_per_gpu_hour=price)

    width = None if args.wide else WIDTH
    _print_plan(args.config, plan, batches.describe(), width, calibration, source)
    if args.json:
        _say(f"wrote {write_json(args.json, {'config': args.config, **plan.as_dict()})}", width)
    return 0
