"""`scaletrain` command: one module per subcommand, each with add_parser() and run()."""

from __future__ import annotations

import os
import sys

from scaletrain.cli import (
    bench,
    checkpoint,
    cluster,
    diagnose,
    doctor,
    lab,
    launch,
    plan,
    report,
    skypilot,
    slurm,
    train,
    verify_resume,
)
from scaletrain.cli.options import Parser
from scaletrain.errors import EXIT_USAGE, TrainingFailed, UserError
from scaletrain.errors import report as report_error

COMMANDS = {"train": train, "launch": launch, "verify-resume": verify_resume, "checkpoint": checkpoint,
            "report": report, "bench": bench, "doctor": doctor, "plan": plan,
            "slurm": slurm, "lab": lab, "diagnose": diagnose, "cluster": cluster, "skypilot": skypilot}


def build_parser() -> Parser:
    from scaletrain import __version__

    parser = Parser(prog="scaletrain", description="One PyTorch training job from a CPU to N GPUs and M "
                    "machines, with no change to the training code.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, module in COMMANDS.items():
        module.add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    where = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" \
        else ""
    try:
        parser = build_parser()
        args, leftovers = parser.parse_known_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        return COMMANDS[args.command].run(args, leftovers, argv)
    except (UserError, TrainingFailed) as err:
        return report_error(err)  # one line, once per job however many ranks raised it
    except KeyboardInterrupt:
        print(f"{where}scaletrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `scaletrain plan ... | head`: the reader left; no traceback, and none at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1  # as rich's console does when the pipe breaks under one of its tables
