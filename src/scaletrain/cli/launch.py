"""`scaletrain launch [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT] SCRIPT.py [ARGS...]`."""

from __future__ import annotations

import argparse
import ast
import os
import time
from pathlib import Path
from typing import Any

from scaletrain.config import build
from scaletrain.env import LAUNCH_DIR_ENV, RUN_DIR, USAGE_SAID, launcher_env_problem, under_launcher
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
    from scaletrain.cluster import forked
    from scaletrain.cluster.torchrun import launch

    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: {_torchrun_option(leftovers[0])}")
    if args.script is None:
        raise UserError("launch needs a SCRIPT to run; fix: scaletrain launch --nproc 2 train.py [ARGS...]")
    dist = build([("command line", {"dist.nproc": args.nproc, "dist.nnodes": args.nnodes,
                                     "dist.rdzv_endpoint": args.rdzv_endpoint, "dist.rdzv_id": args.rdzv_id,
                                     "dist.local_addr": args.local_addr,
                                     "dist.max_restarts": args.max_restarts})]).dist
    if not args.module:
        script = Path(args.script)
        if script.is_dir():
            raise UserError(f"script {args.script!r} is a directory; fix: name the script in it (scaletrain launch "
                            f"--nproc 2 {script / 'train.py'})")
        if not script.is_file():
            raise UserError(f"script {args.script!r} not found; fix: check the path (or use -m for a module)")
        check_script(script)
    elif not _importable(args.script):
        raise UserError(f"module {args.script!r} not found from {Path.cwd()}; fix: check its name, run from the "
                        "directory that holds its package, or install it (pip install -e .)")
    if under_launcher() and launcher_env_problem() is None:  # a whole launcher's set, not a shell's leftovers
        world = os.environ["WORLD_SIZE"]
        raise UserError(f"scaletrain launch runs under a launcher already (it set RANK and WORLD_SIZE={world}): each "
                        f"of its {world} processes would start a job of its own; fix: run scaletrain launch directly, "
                        "once per machine, or let that launcher run the script itself")
    if args.module and args.script in forked.OWN_MODULES:
        forked.serial_launcher()  # scaletrain's own module (the rehearsal's network check): workers may be forks
    # Deterministic, so that every machine of a multi-machine job derives the same id from the same command.
    name = args.script if args.module else Path(args.script).stem
    started = time.time()

    def note(what: str) -> Path:  # what the workers told this launcher (env.tell_launcher), while launch() runs
        return Path(os.environ[LAUNCH_DIR_ENV]) / what

    def after_stop(signum: int) -> int | None:
        """Training through scaletrain: whether it saved, as scaletrain train says it (0 if preempted)."""
        from scaletrain.cli.train import after_signal

        told = note(RUN_DIR)  # a session the script opens names its run directory here
        return after_signal(signum, Path(told.read_text(encoding="utf-8")), started) if told.is_file() else None

    return launch(dist, [args.script, *args.script_args], module=args.module, run_id=f"scaletrain-{name}",
                  after_stop=after_stop, usage_said=lambda: note(USAGE_SAID).is_file(),
                  plain=lambda: not note(RUN_DIR).is_file())


def check_script(script: Path) -> None:
    """What a launcher can tell of a script before any worker starts, each said once in one line: Python cannot
    parse it (each of N workers printed the same SyntaxError traceback, and the launcher said a worker failed
    with exit code 1), or it starts its own processes and their group (_own_processes)."""
    try:
        tree = ast.parse(script.read_bytes(), str(script))
    except SyntaxError as err:
        raise UserError(f"{script}:{err.lineno}: {type(err).__name__}: {err.msg}; fix: correct line {err.lineno} "
                        f"(python -m py_compile {script} says the same)") from None
    except (OSError, ValueError):  # unreadable, or a null byte: python says it, as it would have
        return
    if own := _own_processes(tree):
        raise UserError(f"{script} starts its own processes ({own[0]}, line {own[1]}) and forms their group itself "
                        f"({own[2]}), so each worker a launcher starts would start a job of its own and wait for "
                        f"peers that never come; fix: run it as its author does (python {script}), or let the "
                        "launcher start the workers: drop the spawn and call dist.init_process_group() with no "
                        "rank, as torchrun's workers do")


_SPAWNERS = ("spawn", "start_processes")  # torch.multiprocessing's


def _own_processes(tree: ast.AST) -> tuple[str, int, str] | None:
    """(the call, its line, how it forms the group) where a script starts its worker processes itself, as
    PyTorch's DDP tutorial does (torch.multiprocessing.spawn of a function that calls
    init_process_group(backend, rank=rank, world_size=n) at its own MASTER_PORT): under a launcher every worker
    ran that, the groups collided on one port or waited on a store nobody hosted, and the job hung with no
    word (until a timeout of 30 minutes). Both halves must be there: a script may spawn processes for other work."""
    modules, functions = {"torch.multiprocessing"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch.multiprocessing" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "multiprocessing"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.multiprocessing":
            functions |= {a.asname or a.name for a in node.names if a.name in _SPAWNERS}
    spawn, group, port = None, "", ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in _SPAWNERS and ast.unparse(f.value) in modules) or \
                    (isinstance(f, ast.Name) and f.id in functions):
                spawn = spawn or (ast.unparse(f), node.lineno)
            named = {k.arg for k in node.keywords} & {"rank", "world_size", "init_method"}
            if ast.unparse(f).endswith("init_process_group") and (named or len(node.args) > 1):
                *most, last = sorted(named) or ["rank"]
                group = group or f"init_process_group with its own {', '.join(most)}{' and ' * bool(most)}{last}"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "os.environ" and \
                        isinstance(target.slice, ast.Constant) and target.slice.value == "MASTER_PORT":
                    port = "its own MASTER_PORT"
    return (*spawn, group or port) if spawn and (group or port) else None


# torchrun's options and what scaletrain launch calls them
_TORCHRUN = {"--nproc_per_node": "--nproc", "--nproc-per-node": "--nproc", "--rdzv_endpoint": "--rdzv-endpoint",
             "--rdzv_id": "--rdzv-id", "--max_restarts": "--max-restarts", "--local_addr": "--local-addr"}


def _torchrun_option(arg: str) -> str:
    """The fix for an argument launch does not take: torchrun's spelling of one of its options, or a misplaced one."""
    name = arg.split("=", 1)[0]
    if name in _TORCHRUN:
        return f"scaletrain launch calls it {_TORCHRUN[name]} (torchrun's {name})"
    if name == "--standalone":
        return "leave it out: one machine is the default (scaletrain picks a free port on loopback)"
    if name in ("--rdzv-backend", "--rdzv_backend", "--rdzv-conf", "--rdzv_conf", "--node-rank", "--node_rank",
                "--master-addr", "--master_addr", "--master-port", "--master_port"):
        return (f"leave {name} out: scaletrain launch meets at a c10d rendezvous on --rdzv-endpoint (plain torchrun "
                "takes the rest: torchrun ... SCRIPT)")
    return "put scaletrain's options before SCRIPT (scaletrain launch --help lists them)"


def _importable(module: str) -> bool:
    """Whether ``python -m module`` would find it from here (the workers start in this directory)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(Path.cwd()))  # python -m puts the working directory first
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not exist, or a bad name
        return False
    finally:
        sys.path.pop(0)
