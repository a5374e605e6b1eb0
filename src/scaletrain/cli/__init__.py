"""`scaletrain` command: one module per subcommand, each with add_parser() and run()."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
from typing import NoReturn

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
from scaletrain.env import die_with_launcher, hold_stop_signal, under_launcher
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


class _CtrlCAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs the import of torch and numpy with Ctrl-C held until the module is whole, then raised. A
    KeyboardInterrupt inside torch's import lands in its C++ initialisation (pybind11 turns it into SIGABRT,
    "terminate called after throwing ... KeyboardInterrupt") or leaves numpy half-imported for a later import to
    trip over (AttributeError: module 'numpy' has no attribute 'matrix'): a core dump or a traceback for a Ctrl-C
    in a command's first seconds, where every other Ctrl-C gets one line. Installed by main() only, for the first
    import of each; a library user's own process is left alone. The interrupt is raised from exec_module, so
    importlib drops the whole module from sys.modules as for any failed import: the command is ending anyway."""

    HELD = ("torch", "numpy")

    def __init__(self) -> None:
        self._inner: dict[str, importlib.abc.Loader] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.HELD or fullname in self._inner:
            return None
        self._inner[fullname] = None  # type: ignore[assignment] - this finder's own lookup below skips it
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._inner[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner[spec.name].create_module(spec)

    def exec_module(self, module) -> None:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            self._inner[module.__name__].exec_module(module)  # SIGINT is someone else's here: leave it be
            return
        held: list[int] = []
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        try:
            self._inner[module.__name__].exec_module(module)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["train"], ["launch"]):  # a run, or its launcher: Slurm's USR1 while starting is kept for it
        hold_stop_signal()
    where = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" \
        else ""
    if not any(isinstance(finder, _CtrlCAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CtrlCAfterImport())
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


def run_as_module(argv: list[str] | None = None) -> NoReturn:
    """`python -m scaletrain ARGV`: scaletrain/__main__.py, and a worker the launcher forked (cluster/forked.py)."""
    die_with_launcher()  # a torchrun worker: killed with its agent, not left training on as an orphan
    code = main(argv)
    if under_launcher():
        # A worker of a torchrun job, done: leave without the interpreter's teardown. Gloo's threads can outlive
        # it (FSDP's mesh and DCP hold their groups past destroy_process_group), and one of them taking the GIL
        # then aborts the process after its work is saved ("terminate called without an active exception",
        # SIGABRT; CI, about 1 run in 10 of a 2-rank job). Everything it wrote is closed; flush what is buffered.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
