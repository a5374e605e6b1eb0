"""`scaletrain verify-resume RECIPE|FILE.toml|SCRIPT.py [--steps N] [--at K] [--drop PARTS] [--section.key=value ...]
[-- SCRIPT'S OWN ARGUMENTS]`."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.cli.options import (
    add_config_argument,
    add_config_options,
    check_types,
    config_overrides,
    parse_count,
)
from scaletrain.config import RESTORABLE, load
from scaletrain.errors import ConfigError, UserError

HELP = ("Check that your job resumes exactly: run it straight for N steps, and again interrupted at step K and "
        "resumed; report identical, or the first diverging step and which part of the state differs. The job is a "
        "recipe, a TOML config, or a script whose loop runs in scaletrain.fit() or scaletrain.session().")


def _dropped(text: str) -> str:
    """--drop's parts, checked as debug.skip_restore checks them, and said as --drop when they are not parts."""
    try:
        return load(None, cli_overrides={"debug.skip_restore": text}).debug.skip_restore
    except ConfigError:
        raise UserError(f"--drop = {text!r}: expected a comma-separated subset of {', '.join(RESTORABLE)}; fix: "
                        "--drop rng") from None


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain verify-resume RECIPE|FILE.toml|SCRIPT.py [--steps N] [--at K] [--drop PARTS] "
                             "[--section.key=value ...] [--nproc N] [-- SCRIPT'S OWN ARGUMENTS]")
    add_config_argument(p)
    own = p.add_argument_group("verify-resume")
    own.add_argument("--steps", type=str, default="0", help="steps to compare (0 = up to two epochs, at most 200)")
    own.add_argument("--at", type=str, default="0", help="interrupt after this step (0 = a random mid-epoch step)")
    own.add_argument("--drop", default="", help=f"resume WITHOUT these parts ({', '.join(RESTORABLE)}), "
                     "to see what each is for")
    own.add_argument("--work-dir", default="", help="keep the three runs here (default: a temporary directory)")
    add_config_options(p)


def choose_steps(total: int, per_epoch: int, steps: int, at: int, rng: random.Random) -> tuple[int, int]:
    """(N, K): N steps to compare, interrupted after step K; K random and mid-epoch unless given."""
    n = steps or min(total, max(2 * per_epoch, 20), 200)
    if n > total:
        raise UserError(f"--steps {n}: the job has only {total} steps; fix: --steps {total} or fewer")
    if n < 2:
        raise UserError(f"--steps {n}: at least 2 steps are needed (one before and one after the interruption); "
                        "fix: --steps 20")
    if at:
        if not 1 <= at < n:
            raise UserError(f"--at {at}: expected a step in [1, {n - 1}] (before the last compared step); fix: "
                            f"--at {n // 2}")
        return n, at
    mid = [k for k in range(1, n) if k % per_epoch] or list(range(1, n))
    return n, rng.choice(mid)


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.cli.train import preflight
    from scaletrain.data import build_splits
    from scaletrain.observe.console import Console
    from scaletrain.train.batching import plan_batches
    from scaletrain.train.verify import run_train

    if args.config.endswith(".py"):
        return _verify_script(args, leftovers, argv)
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    cfg = load(args.config, cli_overrides=overrides)
    drop = _dropped(args.drop)
    world = cfg.dist.nproc * cfg.dist.nnodes
    preflight(cfg, world)
    plan = plan_batches(cfg, world, len(build_splits(cfg.data, cfg.model).train))  # type: ignore[arg-type]
    n, k = choose_steps(plan.total_steps, plan.steps_per_epoch, parse_count("--steps", args.steps, 0),
                        parse_count("--at", args.at, 0), random.Random())
    console = Console(True, progress=False)
    epoch, into = divmod(k, plan.steps_per_epoch)
    console.print(f"verify-resume: {args.config} on {world} rank(s), {n} steps, interrupted after step {k} "
                  f"(epoch {epoch + 1}, {into} of {plan.steps_per_epoch} steps in)"
                  + (f", resumed without: {drop}" if drop else ""))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="scaletrain-verify-"))
    if args.work_dir and work.exists() and any(work.iterdir()):
        raise UserError(f"--work-dir {work}: not empty; fix: name a new or empty directory")
    rest = argv[argv.index("verify-resume") + 1:]
    rest.remove(args.config)
    cli = _without_own_values(rest)
    env = dict(os.environ)
    return _three_runs(console, work, n, k, lambda extra, run_dir: run_train(args.config, [*cli, *extra], run_dir, env),
                       [f"--debug.skip_restore={drop}"], keep=bool(args.work_dir))


def _three_runs(console: Any, work: Path, n: int, k: int, run_one: Callable[[list[str], Path], object],
                resume_extra: list[str], *, keep: bool) -> int:
    """Runs A (straight to step n), B (stopped after step k) and C (B resumed in a new process, to n), each
    ``run_one(options, run_dir)``; every step's traced state compared. Exit code 0 when identical, else 1."""
    from scaletrain.train.verify import compare, read_trace

    try:
        console.print(f"  run A: straight to step {n} ...")
        run_one([f"--chaos.interrupt_step={n}"], work / "straight")
        console.print(f"  run B: to step {k}, then stop as if preempted ...")
        run_one([f"--chaos.interrupt_step={k}"], work / "resumed")
        console.print(f"  run C: a new process resumes B's checkpoint and runs to step {n} ...")
        run_one([f"--chaos.interrupt_step={n}", *resume_extra], work / "resumed")
        verdict = compare(read_trace(work / "straight"), _first(work / "resumed", k), _after(work / "resumed", k),
                          n, k)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    console.print(verdict.text())
    if not verdict.identical:
        console.print(f"  differing trace fields: {', '.join(verdict.fields)}")
    return 0 if verdict.identical else 1


def _verify_script(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    """verify-resume for a script whose loop runs in scaletrain.fit() or a session reading the command line: the same three
    runs (straight, stopped after step K, resumed), each `python SCRIPT ARGS` (or `scaletrain launch --nproc N
    SCRIPT ARGS`) with the session's own --run.dir, --debug.trace and --chaos.interrupt_step added."""
    from scaletrain.observe.console import Console
    from scaletrain.train.verify import run_script

    script = args.config
    if not Path(script).is_file():
        raise UserError(f"script {script!r} not found; fix: check the path")
    own = leftovers.index("--") if "--" in leftovers else len(leftovers)
    leftovers, passed = leftovers[:own], leftovers[own + 1:]  # after --: the script's own arguments, as they are
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    cfg = load(None, cli_overrides=overrides)
    world = cfg.dist.nproc * cfg.dist.nnodes
    steps = parse_count("--steps", args.steps, 0)
    # a script has no epochs we know of: every step is as good a place to stop
    n, k = choose_steps(steps or 20, steps or 20, steps, parse_count("--at", args.at, 0), random.Random())
    drop = _dropped(args.drop)
    if drop:
        raise UserError(f"--drop {drop}: a session restores every part; fix: leave --drop out for a script")
    console = Console(True, progress=False)
    console.print(f"verify-resume: {script} on {world} rank(s), {n} steps, interrupted after step {k}")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="scaletrain-verify-"))
    if args.work_dir and work.exists() and any(work.iterdir()):
        raise UserError(f"--work-dir {work}: not empty; fix: name a new or empty directory")
    rest = argv[argv.index("verify-resume") + 1:]
    rest = rest[:rest.index("--")] if "--" in rest else rest
    rest.remove(args.config)
    cli = _without(_without_own_values(rest), ("--nproc", "--dist.nproc"))  # the world is the launcher's
    env = dict(os.environ)
    return _three_runs(console, work, n, k,
                       lambda extra, run_dir: run_script(script, [*passed, *cli, *extra], run_dir, env, world), [],
                       keep=bool(args.work_dir))


_OWN = ("--steps", "--at", "--drop", "--work-dir")


def _without(args: list[str], options: tuple[str, ...]) -> list[str]:
    """``args`` minus ``options`` and their values (``--opt value`` or ``--opt=value``)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if a.startswith(tuple(o + "=" for o in options)):
            continue
        out.append(a)
    return out


def _without_own_values(args: list[str]) -> list[str]:
    """The command line minus verify-resume's own options (and their values), passed on to each run."""
    return _without(args, _OWN)


def _first(run_dir: Path, k: int) -> dict[int, list[dict[str, Any]]]:
    from scaletrain.train.verify import read_trace

    return {r: [x for x in recs if x.get("event", "start") == "start" and x["step"] <= k]  # with its start
            for r, recs in read_trace(run_dir).items()}


def _after(run_dir: Path, k: int) -> dict[int, list[dict[str, Any]]]:
    from scaletrain.train.verify import read_trace

    return {r: [x for x in recs if "event" in x or x["step"] > k] for r, recs in read_trace(run_dir).items()}
