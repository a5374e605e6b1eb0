"""`scaletrain plan RECIPE|FILE.toml --gpu KIND [--nproc N] [--nnodes M] [--price USD] [--section.key=value ...]`.

The data-parallel table and its lines are plan/table.py's (scaletrain.plan_fit() prints them too); the dp x tp x pp
search's table is here. --wide prints a row per layout and a column per quantity (about 150 columns).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table

from scaletrain.cli.options import add_config_argument, add_config_options, check_types, config_overrides
from scaletrain.config import load
from scaletrain.errors import ConfigError, UserError
from scaletrain.plan.table import WIDTH, dollars, print_plan, say, show, size

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.plan.estimate import ModelFacts, Plan
    from scaletrain.plan.parallel import Parallel, Search, Setting, Structure

# Structure.tp_divides: the GPT's, the Llama's
_SPLIT_BY = {2: "heads and MLP width", 4: "heads, key/value heads, MLP width and sequence length"}
PARALLEL_CAPTION = ("m: micro-batches per pipeline, the global batch held, each the trainer's (under the config's "
                    "pipeline data.batch_size / parallel.microbatches, else data.batch_size; accumulation steps at "
                    "pp 1), one pipeline schedule per accumulation step; ckpt: none, selective (x7/6 compute), full (x4/3); "
                    "step = max(compute x (1 + bubble), dp comm) + tp+pp comm (exposed); bubble (pp-1)/(m of a schedule); "
                    "activations per block measured on the tensor-parallel step (fake tensors) x micro-batches in "
                    "flight (docs/plan.md)")
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
    own.add_argument("--tokens", default="", help="a token budget (1e9, 2B, 300B; K M B T = 1e3 1e6 1e9 1e12): "
                     "the run's steps are tokens / (global batch x seq_len), replacing train.max_steps [default: "
                     "train.max_steps]")
    own.add_argument("--search", action="store_true", help="also plan dp x tp x pp layouts (ddp, zero1, zero2, "
                     "fsdp, hsdp; tp within a machine; pp dividing the blocks) of these GPUs and of fewer whole "
                     "machines, and name the fastest and the cheapest that fit [default: only the layout "
                     "--parallel.tp/--parallel.pp give, when either is above 1]")
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


_COUNT = re.compile(r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)([kmbt]?)")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str, flag: str = "--tokens") -> int:
    """'2B' -> 2_000_000_000, '1e9', '300B', '1.5T', '500M', '10_000' (decimal multiples, as token budgets are
    said); a whole number >= 1, or a one-line ConfigError."""
    match = _COUNT.fullmatch(text.strip().lower().replace("_", "").replace(",", ""))
    value = float(match.group(1)) * _SCALE[match.group(2)] if match else 0.0
    if not 1 <= value < 1e18 or value != int(value):
        raise ConfigError(flag, text, "a whole count >= 1 like 1e9, 2B, 300B, 1.5T (K, M, B, T = 1e3, 1e6, 1e9, "
                          "1e12)", f"{flag} 2B")
    return int(value)


PARALLEL_COLUMNS = ("layout", "ckpt", "dp", "tp", "pp", "m", "memory", "step", "bubble", "tp+pp", "GPU-h",
                    "cost $")
SHOWN = 10  # rows of the search's table (fitting layouts, fastest first); --json has every one


def _parallel_requested(cfg: Config, search: bool) -> bool:
    return search or cfg.parallel.tp > 1 or cfg.parallel.pp > 1


def _structure(cfg: Config, task: str, info: dict[str, Any], search: bool) -> Structure:
    """The model's parameters by place (meta device), its degrees checked: a one-line ConfigError for a tp or pp
    the model or the machines cannot take, before anything is measured."""
    import torch

    from scaletrain.models import build_model
    from scaletrain.plan.estimate import BLOCK_MODELS
    from scaletrain.plan.parallel import structure

    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if cfg.model.name not in BLOCK_MODELS:
        key, value = ("parallel.tp", tp) if tp > 1 else ("parallel.pp", pp) if pp > 1 else ("--search", True)
        raise ConfigError(key, value, f"a model of identical blocks to split ({', '.join(BLOCK_MODELS)}), not "
                          f"model.name = {cfg.model.name!r}", "plan it without --search, --parallel.tp, --parallel.pp")
    with torch.device("meta"):
        shape = structure(build_model(cfg.model, task, info), int(info.get("seq_len", cfg.data.seq_len)))
    per_node, world = cfg.dist.nproc, cfg.dist.nproc * cfg.dist.nnodes
    if tp > 1 and shape.tp_why_not:
        raise ConfigError("parallel.tp", tp, f"1 for this model: {shape.tp_why_not}",
                          "--parallel.tp=1, or --model.name=llama (a built-in Llama splits)")
    bad = next((n for n in (per_node, *shape.tp_divides) if n % tp), None)
    if bad is not None:
        what = (f"a divisor of the {per_node} GPUs of a machine (tensor parallelism communicates every block: it "
                "stays within a machine)" if bad == per_node else
                f"a divisor of the {_SPLIT_BY[len(shape.tp_divides)]} {'/'.join(map(str, shape.tp_divides))}")
        good = max(d for d in range(1, tp) if per_node % d == 0 and all(n % d == 0 for n in shape.tp_divides))
        raise ConfigError("parallel.tp", tp, what, f"--parallel.tp={good}")
    if pp > shape.n_layer or world % (tp * pp):
        good = max(d for d in range(1, min(pp, shape.n_layer + 1)) if world % (tp * d) == 0)
        raise ConfigError("parallel.pp", pp, f"at most model.n_layer = {shape.n_layer} stages, with pp x tp "
                          f"dividing the {world} GPUs (here {pp} x {tp} = {pp * tp})",
                          f"--parallel.pp={good}, or --nproc/--nnodes a multiple of pp x tp")
    return shape


def _micro_batch_config(cfg: Config, source: str, overrides: dict[str, str]) -> Config:
    """The config the dp x tp x pp table plans: the trainer's micro-batch. Under the config's pipeline each rank's
    data.batch_size is split into parallel.microbatches (0: 2 x pp), so m is that many x accumulation at its own
    layout; a batch the trainer cannot split (a recipe's one sequence) is planned whole, the trainer's refusal
    said as a warning. ``cfg`` itself when the micro-batch is its data.batch_size."""
    if cfg.parallel.pp == 1:
        return cfg
    from scaletrain.layout import check_pipeline

    rows = cfg.data.batch_size
    try:
        rows //= check_pipeline(cfg.parallel, cfg.data.batch_size)
    except ConfigError as err:
        print(f"scaletrain: warning: {err} (the trainer would refuse it); planned in micro-batches of "
              f"data.batch_size = {rows} sample(s), as its first fix runs them", file=sys.stderr)
    if rows == cfg.data.batch_size:
        return cfg
    return load(source, cli_overrides={**overrides, "data.batch_size": str(rows)}).for_device("cuda")


def _setting(cfg: Config, plan: Plan, facts: ModelFacts, shape: Structure, global_batch: int) -> Setting:
    from scaletrain.layout import virtual_stages
    from scaletrain.plan.parallel import Setting

    # cfg's data.batch_size: the micro-batch (a pipeline's config: its batch split into parallel.microbatches)
    # and a schedule per accumulation step, of parallel.microbatches, as the trainer runs a pipeline
    per_schedule = (cfg.parallel.microbatches or 2 * cfg.parallel.pp) if cfg.parallel.pp > 1 else 0
    return Setting(facts, shape, plan.accelerator, plan.gpus_per_node, plan.precision, plan.tf32,
                   cfg.data.batch_size, global_batch, cfg.parallel.pp_schedule, cfg.optim.name, plan.mfu,
                   plan.net_bytes_per_s, plan.usable_bytes, virtual_stages(cfg.parallel), per_schedule)


def _anchored(cfg: Config, plan: Plan, setting: Setting | None, given: float) -> tuple[float, str]:
    """(compute efficiency, what it is) for ``--mfu given``: the MFU of this config's own layout over whole
    steps, as summary.json and published runs count it (the model's FLOPs over the step's wall time). ``plan``
    and ``setting`` are planned at efficiency 1; the efficiency found is the one every layout is timed at."""
    from scaletrain.plan.estimate import AC_PLANNED
    from scaletrain.plan.parallel import kinds, parallel_layout

    ac, strategy = cfg.memory.activation_checkpointing, cfg.parallel.strategy

    def kind(offered: list[str]) -> str:  # the config's strategy where planned (auto, hsdp on one machine: fsdp)
        return strategy if strategy in offered else "fsdp" if "fsdp" in offered else "ddp"

    if setting is not None and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        lay: Any = parallel_layout(setting, kind(kinds(plan.world // (tp * pp), tp, plan.gpus_per_node)), ac,
                                   gpus=plan.world, tp=tp, pp=pp)
        name = lay.name
    else:
        ac = ac if ac in AC_PLANNED else "none"  # the data-parallel table plans none and full
        if strategy == "auto" and plan.choice is not None:
            strategy = plan.choice.strategy
        name = kind([lay.strategy for lay in plan.layouts])
        lay = next(lay for lay in plan.layouts if (lay.strategy, lay.checkpointing) == (name, ac))
    efficiency = lay.efficiency_for(given)
    said = (f"--mfu {given:g} is that of this config's own layout ({name}, checkpointing {ac}) over whole steps, "
            f"as summary.json and published runs count MFU: its GPUs then compute at {efficiency:.3g} of peak "
            "(the bubble, exposed communication and recompute taken out), the rate every layout here is timed at")
    if (reached := lay.mfu_at(efficiency)) < given * 0.995:
        said += (f"; under the plan's model that layout reaches at most MFU {reached:.3g} (its communication and "
                 "bubble leave no more)")
    return efficiency, said


def _search(cfg: Config, plan: Plan, facts: ModelFacts, shape: Structure, search: bool,
            global_batch: int) -> Search:
    """The dp x tp x pp layouts at the run's ``global_batch`` (the one its token budget and steps count: the
    trainer's, data.batch_size x the data-parallel ranks x accumulation, or train.global_batch, which
    plan_batches checked splits over the given pair's data-parallel ranks)."""
    from scaletrain.plan.parallel import search as run_search

    setting = _setting(cfg, plan, facts, shape, global_batch)
    only = None if search else (cfg.parallel.tp, cfg.parallel.pp)
    return run_search(setting, gpus=plan.world, nodes=plan.nodes, total_steps=plan.total_steps,
                      price_per_gpu_hour=plan.price_per_gpu_hour, only=only)


def _parallel_cells(found: Search, lay: Parallel) -> list[str]:
    from scaletrain.plan.estimate import fmt_seconds

    cost = found.cost(lay)
    return [lay.kind, lay.checkpointing, str(lay.dp), str(lay.tp), str(lay.pp), str(lay.microbatches),
            size(lay.total_bytes) + ("" if lay.fits else " NO"), fmt_seconds(lay.step_s), f"{lay.bubble:.0%}",
            fmt_seconds(lay.tp_comm_s + lay.pp_comm_s), _hours(found.gpu_hours(lay)),
            "-" if cost is None else dollars(cost)]


def _print_search(found: Search, searched: bool, width: int | None) -> None:
    """The dp x tp x pp layouts (the search's fitting ones, fastest first, or the given pair's all), and the
    fastest and the cheapest that fit."""
    from scaletrain.plan.estimate import fmt_seconds

    rows = found.fitting()[:SHOWN] if searched else found.layouts
    table = Table(box=box.HORIZONTALS, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1))
    for i, name in enumerate(PARALLEL_COLUMNS):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=True)
    for lay in rows:
        table.add_row(*_parallel_cells(found, lay))
    fits = len(found.fitting())
    head = (f"dp x tp x pp layouts: the {len(rows)} fastest of {fits} that fit ({len(found.layouts)} planned, on "
            f"{found.gpus} GPUs and fewer whole machines)" if searched else
            f"dp x tp x pp layouts at tp {rows[0].tp}, pp {rows[0].pp} on {found.gpus} GPUs")
    say(head + "; memory per GPU of the largest stage (NO: does not fit)", width)
    show(table, width)
    say(PARALLEL_CAPTION, width)
    for word, lay in (("fastest", found.fastest), ("cheapest", found.cheapest)):
        if lay is None:
            say(f"plan: {word}: no layout fits" + (" on all the GPUs" if word == "fastest" else ""), width)
            continue
        cost = found.cost(lay)
        say(f"plan: {word} that fits: {lay.name} on {lay.gpus} GPUs, checkpointing {lay.checkpointing}, "
             f"m {lay.microbatches}: {size(lay.total_bytes)} per GPU, {fmt_seconds(lay.step_s)} per step "
             f"(MFU {lay.step_mfu:.2f} of the whole step), "
             f"{fmt_seconds(found.run_hours(lay) * 3600)}, {_hours(found.gpu_hours(lay))} GPU-hours"
             + ("" if cost is None else f", ${dollars(cost)}")
             + f" (--parallel.tp={lay.tp} --parallel.pp={lay.pp})", width)


def _hours(h: float) -> str:
    """GPU-hours: whole ones from 100 on, else 3 significant digits."""
    return f"{h:,.0f}" if h >= 99.5 else f"{h:.3g}"


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.plan.catalog import ACCELERATORS, default_mfu

    acc = ACCELERATORS.get(args.gpu.lower())
    if acc is None:
        raise UserError(f"--gpu = {args.gpu!r}: expected one of {', '.join(ACCELERATORS)}; fix: --gpu h100")
    mfu = _number("--mfu", args.mfu, 0.0, 1.0, "0.4") if args.mfu is not None else 0.0
    net = _number("--net-gbps", args.net_gbps, 0.0, 1e6, "400") * 1e9 / 8
    price = _number("--price", args.price, 0.0, 1e6, "2.5") if args.price else None
    tokens = parse_count(args.tokens) if args.tokens else None
    calibration = None
    if args.calibrate:  # read before the model is measured: a run that cannot calibrate is said at once
        from scaletrain.plan.actual import calibrate

        calibration = calibrate(args.calibrate, acc.key)
        if calibration.mfu is None and calibration.activations is None:
            raise UserError(f"--calibrate {' '.join(args.calibrate)}: no MFU and no activations measured in these "
                            "runs; fix: calibrate with runs of a built-in model on this --gpu")
    from scaletrain.bench.report import check_output_path, write_json
    from scaletrain.data import build_splits
    from scaletrain.plan.estimate import (
        AC_PLANNED,
        AC_SEARCHED,
        compile_ratio,
        make_plan,
        measure_model,
        steps_for_tokens,
        with_block_activations,
        with_tp_activations,
    )
    from scaletrain.train.batching import plan_batches

    check_output_path(args.json or None, "--json", ".json")
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    if overrides.get("dist.nnodes", "1") != "1":  # a plan needs no rendezvous; the run will
        overrides.setdefault("dist.rdzv_endpoint", "planned:29500")
    cfg = load(args.config, cli_overrides=overrides).for_device("cuda")  # a plan is for a GPU (--gpu)
    world = cfg.dist.nproc * cfg.dist.nnodes
    splits = build_splits(cfg.data, cfg.model)
    parallel = _parallel_requested(cfg, args.search)
    shape = _structure(cfg, splits.task, splits.info, args.search) if parallel else None  # degrees checked first
    batches = plan_batches(cfg, world, len(splits.train))  # type: ignore[arg-type]
    sample = splits.train[0][0]
    pcfg = _micro_batch_config(cfg, args.config, overrides) if parallel else cfg

    def measured(at: Config, modes: Any) -> ModelFacts:
        return measure_model(at, splits.task, splits.info, sample, target=splits.train[0][1], modes=modes)

    facts = measured(cfg, AC_SEARCHED if parallel and pcfg is cfg else AC_PLANNED)
    pfacts = facts  # the dp x tp x pp table's: at the trainer's micro-batch, with the blocks and tp steps measured
    if parallel:
        from scaletrain.plan.parallel import tp_degrees

        pfacts = facts if pcfg is cfg else measured(pcfg, AC_SEARCHED)
        pfacts = with_block_activations(pcfg, splits.task, splits.info, sample, pfacts, target=splits.train[0][1])
        degrees = tp_degrees(shape, cfg.dist.nproc) if args.search else [cfg.parallel.tp]  # type: ignore[arg-type]
        pfacts = with_tp_activations(pcfg, splits.task, splits.info, sample, pfacts, degrees,
                                     target=splits.train[0][1])
        facts = pfacts if pcfg is cfg else facts
    total_steps = batches.total_steps
    if tokens is not None:
        if not facts.tokens_per_sample:
            raise ConfigError("--tokens", args.tokens, "no token budget for a model that reads no tokens "
                              f"(model.name = {cfg.model.name!r})", "--train.max_steps instead")
        total_steps = steps_for_tokens(tokens, batches.global_batch, facts.tokens_per_sample)
    source = ""
    if args.mfu is None:
        mfu, source = default_mfu(acc.key, compiled=cfg.train.compile, params=facts.params,
                                  tokens=cfg.data.batch_size * facts.tokens_per_sample)
    if calibration is not None:
        if calibration.mfu is not None and args.mfu is None:  # an explicit --mfu wins
            mfu, source = calibration.mfu, "the calibrating runs'"
        if calibration.activations is not None:
            scale = calibration.activations  # in place of compile's ratio: the eager plan times the runs' own

            def calibrated(f: ModelFacts) -> ModelFacts:
                return f.scaled(lambda key: scale / compile_ratio(cfg, f.params, key))

            one = pfacts is facts
            facts = calibrated(facts)
            pfacts = facts if one else calibrated(pfacts)
    if shape is not None and cfg.parallel.microbatches and cfg.parallel.pp == 1:
        print(f"scaletrain: warning: parallel.microbatches = {cfg.parallel.microbatches} ignored by the plan: "
              "without a pipeline (parallel.pp = 1) there is nothing to split (the m column: accumulation steps)",
              file=sys.stderr)

    def planned(efficiency: float) -> Plan:
        return make_plan(cfg, facts, acc, total_steps=total_steps, accum_steps=batches.accum_steps, mfu=efficiency,
                         net_bytes_per_s=net, price_per_gpu_hour=price)

    given = mfu if args.mfu is not None else None
    if given is not None:  # the MFU of the config's own layout: the efficiency that gives it that MFU
        at_one = planned(1.0)
        mfu, source = _anchored(cfg, at_one, None if shape is None else
                                _setting(pcfg, at_one, pfacts, shape, batches.global_batch), given)
    plan = planned(mfu)
    found = _search(pcfg, plan, pfacts, shape, args.search, batches.global_batch) if shape is not None else None

    width = None if args.wide else WIDTH
    print_plan(args.config, plan, batches.describe(), width, calibration, source, given)
    if tokens is not None:
        global_tokens = batches.global_batch * facts.tokens_per_sample
        say(f"budget: {tokens:,} tokens (--tokens {args.tokens}) = {total_steps:,} steps of {global_tokens:,} "
             f"tokens (train.max_steps not used)", width)
    if found is not None:
        _print_search(found, args.search, width)
    if args.json:
        record = {"config": args.config, "tokens": tokens, "mfu_given": given, **plan.as_dict(),
                  **({"parallel": found.as_dict()} if found is not None else {})}
        say(f"wrote {write_json(args.json, record)}", width)
    return 0
