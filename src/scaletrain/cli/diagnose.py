"""`scaletrain diagnose RUN_DIR`: which rank did not reach which collective, and where it was (observe/flight.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

HELP = ("After a job hung or lost a rank: read every rank's flight record (RUN_DIR/flight/) and say which rank(s) "
        "did not reach which collective, and where in the code they were.")


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP, usage="scaletrain diagnose RUN_DIR", allow_abbrev=False)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (--run.dir) of the job")


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.observe.flight import diagnose

    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: scaletrain diagnose RUN_DIR")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory; fix: scaletrain diagnose runs/NAME (the job's --run.dir)")
    finding = diagnose(run_dir, _world_size(run_dir))
    print(finding.line)
    for line in finding.details:
        print(f"  {line}")
    return 0


def _world_size(run_dir: Path) -> int | None:
    """The job's world size from the last attempt's start record in metrics.jsonl: a rank killed outright writes
    no flight record, and without it the ranks that did would look like the whole job."""
    from scaletrain.observe.metrics import read_records

    starts = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "start"]
    world = starts[-1].get("world_size") if starts else None
    return world if isinstance(world, int) else None
