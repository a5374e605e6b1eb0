"""`scaletrain slurm RECIPE|FILE.toml|SCRIPT.py --nodes N --gpus-per-node G [--time T] [--out job.sbatch]
[--section.key=value ...] [-- SCRIPT'S OWN ARGUMENTS]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from scaletrain.cli.options import (
    add_config_options,
    check_types,
    config_overrides,
    load_job,
    parse_count,
    parse_port,
    recipe_names,
)
from scaletrain.errors import UserError

HELP = ("Write an sbatch script that runs this training job on N machines x G GPUs under Slurm: one torchrun "
        "agent per machine, a checkpoint and a requeue before the time limit, resumed where it stopped. A script of "
        "your own runs through scaletrain launch: a fit() or session script gets --run.dir and "
        "the options and is requeued as a recipe is; one that never names scaletrain runs as torchrun runs it.")
# What the script sets itself, from --nodes and --gpus-per-node and Slurm's variables.
MAX_SIGNAL_S = 65535  # sbatch --signal=SIG@TIME: TIME is 0..65535 seconds
_LAYOUT = {"dist.nproc": "--gpus-per-node", "dist.nnodes": "--nodes", "dist.rdzv_endpoint": "--nodes",
           "dist.rdzv_id": "--nodes"}


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain slurm RECIPE|FILE.toml|SCRIPT.py --nodes N --gpus-per-node G "
                             "[--time 04:00:00] [--launcher torchrun|srun] [--partition P] [--account A] "
                             "[--out job.sbatch] "
                             "[--section.key=value ...] [-- SCRIPT'S OWN ARGUMENTS]")
    p.add_argument("config", metavar="RECIPE|FILE.toml|SCRIPT.py",
                   help=f"a built-in recipe ({', '.join(recipe_names())}), a TOML file with [section] tables, or a "
                   "training script of your own (fit() or a session, reading the command line, or one written for "
                   "plain torchrun)")
    own = p.add_argument_group("slurm")
    own.add_argument("--nodes", default="1", help="machines [default: 1]")
    own.add_argument("--gpus-per-node", default="8", help="GPUs (workers) per machine [default: 8]")
    own.add_argument("--time", default="04:00:00", help="Slurm's time limit [default: 04:00:00]")
    own.add_argument("--launcher", default="torchrun", help="torchrun: one task per machine, a torchrun agent "
                     "starting a worker per GPU (restarts, the c10d rendezvous); srun: one task per GPU, each a "
                     "worker, rank and world from Slurm's variables (clusters that forbid agents, or bind a GPU "
                     "per task) [default: torchrun]")
    own.add_argument("--cpus-per-task", default="0", help="CPUs for each task (0 = 8 per GPU: 8 x G for a "
                     "machine's agent, 8 for a GPU's task) [default: 0]")
    own.add_argument("--signal-s", default="120",
                     help="seconds before the time limit at which the run saves and stops [default: 120]")
    own.add_argument("--port", default="auto", help="the rendezvous port on the first machine (auto: 29500 + the "
                     "job id mod 1000, so that jobs sharing a first machine do not collide) [default: auto]")
    own.add_argument("--partition", default="", help="Slurm partition [default: the cluster's]")
    own.add_argument("--account", default="", help="Slurm account [default: yours]")
    own.add_argument("--out", default="", help="write the script here [default: standard output]")
    add_config_options(p)


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.cluster.slurm import SlurmJob, check_time, detect_env, sbatch_script, time_limit_s
    from scaletrain.config import spec

    nodes = parse_count("--nodes", args.nodes, 1, "2")
    most = int(spec("dist.nnodes").most)  # type: ignore[union-attr]  # said of the flag typed (--nnodes is refused)
    if nodes > most:
        raise UserError(f"--nodes = {args.nodes!r}: expected at most {most:,} machines; fix: --nodes 2")
    gpus = parse_count("--gpus-per-node", args.gpus_per_node, 1, "8")
    if args.launcher not in ("torchrun", "srun"):
        raise UserError(f"--launcher = {args.launcher!r}: expected torchrun or srun; fix: --launcher srun")
    cpus = parse_count("--cpus-per-task", args.cpus_per_task, 0, "64") or 8 * (1 if args.launcher == "srun" else gpus)
    signal_s = parse_count("--signal-s", args.signal_s, 1, "120")
    port = 0 if args.port == "auto" else parse_port(args.port)
    time = check_time(args.time)
    if signal_s > MAX_SIGNAL_S:
        raise UserError(f"--signal-s = {args.signal_s!r}: Slurm's --signal takes at most {MAX_SIGNAL_S} seconds; "
                        "fix: --signal-s 120")
    limit = time_limit_s(time)
    if limit and signal_s >= limit:  # the warning would come at the start: each run saves, requeues, repeats
        raise UserError(f"--signal-s = {signal_s}: the warning before the time limit must come after the job "
                        f"starts, and --time {time} is {limit:,} s; fix: --signal-s {max(1, limit // 10)}, or a "
                        "longer --time")
    if args.out and Path(args.out).exists():
        raise UserError(f"--out = {args.out!r}: the file exists, and is not overwritten; fix: another --out, or "
                        "remove it first")
    script = args.config.endswith(".py")
    own = leftovers.index("--") if "--" in leftovers and script else len(leftovers)
    leftovers, script_args = leftovers[:own], leftovers[own + 1:]  # after --: a script's own, as they are
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    for key, flag in _LAYOUT.items():
        if key in overrides:
            raise UserError(f"--{key} = {overrides[key]!r}: the script sets it from {flag} and Slurm's "
                            f"variables; fix: drop it and use {flag}")
    plain = script and _plain_script(args.config, overrides, args.launcher)
    if script:  # the options a session of the script will read, checked now; its layout is the script's
        from scaletrain.config import load

        cfg = load(None, cli_overrides=overrides)
        name = Path(args.config).stem
        run_dir = "" if plain else cfg.run.dir or f"runs/{name}"
    else:
        cfg = load_job(args.config, overrides, nproc=gpus, nnodes=nodes, endpoint="head:29500")
        name, run_dir = cfg.run.name, cfg.run.dir or f"runs/{cfg.run.name}"
    passed = [f"--{k}={v}" for k, v in overrides.items() if k != "run.dir"]
    job = SlurmJob(nodes, gpus, time, cpus, signal_s, args.partition, args.account, f"scaletrain-{name}",
                   port, args.launcher)
    env = detect_env(sys.prefix, sys.base_prefix, os.environ, sys.argv[0])
    text = sbatch_script(job, args.config, passed, run_dir, env, script_args=script_args if script else None)
    if not args.out:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text, encoding="utf-8")
    where = f"run directory {run_dir}" if run_dir else "a script without a scaletrain session: not requeued"
    print(f"wrote {args.out}: {nodes} machine(s) x {gpus} GPU(s), {where}; submit with: sbatch {args.out}",
          file=sys.stderr)
    return 0


def _plain_script(path: str, overrides: dict[str, str], launcher: str) -> bool:
    """Whether SCRIPT.py runs without scaletrain (a script written for plain torchrun: it never names it), checked
    against what the job would give it: --section.key options a session reads, the srun launcher's tasks (each
    its rank from Slurm's variables, which only a session reads)."""
    from scaletrain.cli.launch import check_script

    script = Path(path)
    if not script.is_file():
        raise UserError(f"script {path!r} not found; fix: check the path (from the directory sbatch will run in)")
    check_script(script)
    if "scaletrain" in script.read_text(encoding="utf-8", errors="replace"):
        return False
    if overrides:
        key = next(iter(overrides))
        raise UserError(f"--{key} = {overrides[key]!r}: {path} never names scaletrain, so no session reads its "
                        "options; fix: pass the script's own arguments after --, or run its loop in "
                        "scaletrain.fit() / scaletrain.session()")
    if launcher == "srun":
        raise UserError(f"--launcher = 'srun': {path} never names scaletrain, and a task started by srun gets its "
                        "rank from Slurm's variables, which only a session reads (a torchrun script reads "
                        "torchrun's); fix: --launcher torchrun")
    return True
