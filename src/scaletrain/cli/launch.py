"""`scaletrain launch [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT] SCRIPT.py [ARGS...]`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scaletrain.config import build
from scaletrain.errors import UserError

HELP = "Run your own script on N local workers (and M machines) through torchrun, like torchrun itself."


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain launch [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT] SCRIPT [ARGS...]")
    p.add_argument("--nproc", default="1", help="worker processes on this machine [default: 1]")
    p.add_argument("--nnodes", default="1", help="machines in the job [default: 1]")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT where the machines meet (needed when nnodes > 1)")
    p.add_argument("--local-addr", default="",
                   help="this machine's address on the job's network [default: its host name]")
    p.add_argument("--rdzv-id", default="",
                   help="job id shared by all machines of one job [default: scaletrain-<SCRIPT's name>]")
    p.add_argument("--max-restarts", default="0", help="restarts of the worker group after a failure [default: 0]")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m SCRIPT)")
    # Optional here so that a missing SCRIPT is our one-line error, not argparse's list of positionals.
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (or module, with -m)")
    p.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments passed on to the script")


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.cluster.torchrun import launch

    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: put scaletrain's options before SCRIPT")
    if args.script is None:
        raise UserError("launch needs a SCRIPT to run; fix: scaletrain launch --nproc 2 train.py [ARGS...]")
    dist = build([("command line", {"dist.nproc": args.nproc, "dist.nnodes": args.nnodes,
                                     "dist.rdzv_endpoint": args.rdzv_endpoint, "dist.rdzv_id": args.rdzv_id,
                                     "dist.local_addr": args.local_addr,
                                     "dist.max_restarts": args.max_restarts})]).dist
    if not args.module and not Path(args.script).is_file():
        raise UserError(f"script {args.script!r} not found; fix: check the path (or use -m for a module)")
    # Deterministic, so that every machine of a multi-machine job derives the same id from the same command.
    name = args.script if args.module else Path(args.script).stem
    return launch(dist, [args.script, *args.script_args], module=args.module, run_id=f"scaletrain-{name}")
