"""`scaletrain lab NAME ...`: what scale does to learning, as lessons with numbers and plots (docs/labs.md).

Each lab is a module of scaletrain.labs with ``add_parser(sub, name)`` and ``run(args, leftovers) -> int``,
imported only when its lab runs (they use matplotlib, and the batch-size lab the trainer). Every lab writes its
numbers (lab.json) and plots (PNG) to a directory of its own and prints a short reading of them.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from scaletrain.cli.options import Parser
from scaletrain.errors import UserError

HELP = "Labs on what scale does to learning: gradient descent vs SGD, the batch size, scaling laws."
LABS = {"descent": "descent", "batch-size": "batch_size", "scaling-law": "scaling_law"}  # name -> scaletrain.labs module


def _lab(name: str) -> Any:
    return importlib.import_module(f"scaletrain.labs.{LABS[name]}")


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage=f"scaletrain lab {{{','.join(LABS)}}} ...")
    labs = p.add_subparsers(dest="lab", metavar="LAB", parser_class=Parser, prog="scaletrain lab")
    for lab in LABS:
        _lab(lab).add_parser(labs, lab)


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    if args.lab is None:
        raise UserError(f"scaletrain lab needs a lab: one of {', '.join(LABS)}; fix: scaletrain lab descent")
    return int(_lab(args.lab).run(args, leftovers))
