"""`scaletrain plan RECIPE|FILE.toml --gpu KIND [--nproc N] [--nnodes M] [--price USD] [--section.key=value ...]`."""

from __future__ import annotations

import argparse
from typing import Any

from scaletrain.cli.options import add_config_argument, add_config_options, check_types, config_overrides
from scaletrain.config import load
from scaletrain.errors import UserError

HELP = ("Before a run: memory per GPU for DDP, FSDP and HSDP, with and without activation checkpointing, the "
        "time per step and of the run, its cost, and the layout to use. Nothing runs on a GPU: the model is "
        "built on fake tensors.")


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.plan.catalog import ACCELERATORS

    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain plan RECIPE|FILE.toml --gpu KIND [--nproc GPUS_PER_MACHINE] "
                             "[--nnodes MACHINES] [--price USD_PER_GPU_HOUR] [--section.key=value ...]")
    add_config_argument(p)
    own = p.add_argument_group("plan")
    own.add_argument("--gpu", default="h100", help=f"the accelerator: {', '.join(ACCELERATORS)} [default: h100]")
    own.add_argument("--mfu", default="0.4", help="model FLOPs utilization to assume, in (0, 1] [default: 0.4]")
    own.add_argument("--net-gbps", default="400", help="network between machines, Gb/s per GPU [default: 400]")
    own.add_argument("--price", default="", help="US dollars per GPU-hour, for the run's cost [default: none]")
    own.add_argument("--json", default="", help="also write the plan to this file")
    add_config_options(p)


def _number(flag: str, text: str, low: float, high: float, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low < value <= high:
        raise UserError(f"{flag} = {text!r}: expected a number in ({low:g}, {high:g}]; fix: {flag} {example}")
    return value


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.bench.report import check_output_path, print_table, write_json
    from scaletrain.data import build_splits
    from scaletrain.observe.memory import fmt_bytes
    from scaletrain.plan.catalog import ACCELERATORS
    from scaletrain.plan.estimate import fmt_seconds, make_plan, measure_model
    from scaletrain.train.batching import plan_batches

    acc = ACCELERATORS.get(args.gpu.lower())
    if acc is None:
        raise UserError(f"--gpu = {args.gpu!r}: expected one of {', '.join(ACCELERATORS)}; fix: --gpu h100")
    mfu = _number("--mfu", args.mfu, 0.0, 1.0, "0.4")
    net = _number("--net-gbps", args.net_gbps, 0.0, 1e6, "400") * 1e9 / 8
    price = _number("--price", args.price, 0.0, 1e6, "2.5") if args.price else None
    check_output_path(args.json or None, "--json", ".json")
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    if overrides.get("dist.nnodes", "1") != "1":  # a plan needs no rendezvous; the run will
        overrides.setdefault("dist.rdzv_endpoint", "planned:29500")
    cfg = load(args.config, cli_overrides=overrides)
    world = cfg.dist.nproc * cfg.dist.nnodes
    splits = build_splits(cfg.data, cfg.model)
    batches = plan_batches(cfg, world, len(splits.train))  # type: ignore[arg-type]
    sample = splits.train[0][0]
    facts = measure_model(cfg, splits.task, splits.info, sample)
    plan = make_plan(cfg, facts, acc, total_steps=batches.total_steps, accum_steps=batches.accum_steps, mfu=mfu,
                     net_bytes_per_s=net, price_per_gpu_hour=price)

    per = f" ({facts.tokens_per_sample} tokens each)" if facts.tokens_per_sample else ""
    print(f"plan: {args.config} on {cfg.dist.nnodes} x {cfg.dist.nproc} {acc.key} ({acc.name}, "
          f"{acc.memory_bytes / 2**30:.1f} GiB, {acc.peak(cfg.train.precision) / 1e12:.0f} TFLOP/s "
          f"{cfg.train.precision}), {batches.total_steps} steps, MFU {mfu:g} assumed")
    print(f"model: {facts.params / 1e6:.1f}M parameters, {facts.flops_per_sample / 1e9:.3g} GFLOP per sample"
          f"{per}; {batches.describe()}")
    rows = []
    for lay in plan.layouts:
        cost = plan.cost(lay)
        rows.append([lay.strategy, lay.checkpointing, *(fmt_bytes(b) for b in (
            lay.params_bytes, lay.grads_bytes, lay.optim_bytes, lay.activations_bytes, lay.fsdp_buffers_bytes,
            lay.total_bytes)), "yes" if lay.fits else "NO", fmt_seconds(lay.compute_s), fmt_seconds(lay.comm_s),
            fmt_seconds(plan.run_hours(lay) * 3600), "-" if cost is None else f"{cost:,.2f}"])
    print_table(f"memory per GPU (fits: within {fmt_bytes(plan.usable_bytes)}, 80%) and time per step",
                ["layout", "checkpointing", "params", "grads", "optimizer", "activations", "fsdp buffers",
                 "total", "fits", "compute", "comm", "run", "cost $"], rows,
                caption="compute: FLOPs / (GPUs x peak x MFU), +1/3 with full checkpointing; comm: ring "
                "collectives at the link rate, a lower bound; step = max(compute, comm) (docs/plan.md)")
    verdict = f"use {plan.choice.strategy}" if plan.choice else "no layout fits"
    print(f"plan: {verdict}: {plan.reason}")
    if args.json:
        print(f"wrote {write_json(args.json, {'config': args.config, **plan.as_dict()})}")
    return 0
