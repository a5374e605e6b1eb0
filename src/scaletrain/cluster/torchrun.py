"""Starting workers through torchrun's own API (torch.distributed.run), never a home-made spawner."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
from typing import Any

from scaletrain.config import DistConfig

# The agent stops the surviving workers with SIGTERM (then SIGKILL): those exits are consequences, not causes.
# A worker that catches SIGTERM (preemption) and then cannot save exits with 128 + SIGTERM instead.
_STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def _is_local(endpoint: str) -> bool:
    return not endpoint or endpoint.rpartition(":")[0] in ("127.0.0.1", "localhost", "::1", "[::1]")


def torchrun_args(cfg: DistConfig, target: list[str], *, module: bool, run_id: str) -> list[str]:
    """torchrun's options for this machine's workers and the script (or module) ``target[0]``."""
    args = [f"--nproc-per-node={cfg.nproc}", f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint or '127.0.0.1:0'}", f"--rdzv-id={cfg.rdzv_id or run_id}",
            f"--max-restarts={cfg.max_restarts}"]
    if _is_local(cfg.rdzv_endpoint):
        # The address this agent gives its workers as MASTER_ADDR; the default would be the host's FQDN.
        args.append("--local-addr=127.0.0.1")
    return args + (["-m"] if module else []) + target[:1]


def _exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"failed with exit code {exitcode}"


def root_failure(failures: dict[int, Any]) -> tuple[int, int]:
    """(global rank, exit code) of the worker that most likely failed first.

    A worker the agent stopped because another one failed comes last; then the earliest failure (torch
    records whole seconds), then the lowest rank.
    """
    rank = min(failures, key=lambda r: (failures[r].exitcode in _STOPPED_BY_AGENT, failures[r].timestamp, r))
    return rank, failures[rank].exitcode


def _quiet_agent_logs() -> None:
    """Keep torchrun's agent to errors: its loggers set their own level (WARNING, or $LOGLEVEL), so a parent's
    level would not reach them, and at WARNING it reports routine events (the heartbeat of an agent whose
    peer already finished, the stopping of workers). Worker failures and rendezvous errors reach the user
    as one scaletrain line instead; set LOGLEVEL (e.g. INFO) to see the agent's own account."""
    if "LOGLEVEL" in os.environ:
        return
    # Imported first so that the loggers they create at import time exist when the levels are set.
    for module in ("torch.distributed.run", "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
                   "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"):
        importlib.import_module(module)
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.ERROR)


def launch(cfg: DistConfig, target: list[str], *, module: bool = False, run_id: str = "scaletrain",
           report_signal: bool = True) -> int:
    """Start cfg.nproc workers on this machine and wait for them; returns the job's exit code.

    On one machine everything stays on loopback: the rendezvous store, MASTER_ADDR, and Gloo's sockets
    (GLOO_SOCKET_IFNAME), which would otherwise bind the address the host name resolves to. Every agent of
    a multi-machine job must pass the same run_id (cfg.rdzv_id wins over it).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if _is_local(cfg.rdzv_endpoint) and (lo := _loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    # torchrun would set 1 and print a banner about it; on CPUs give each worker its share of the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    _quiet_agent_logs()
    parsed = torchrun.get_args_parser().parse_args(torchrun_args(cfg, target, module=module, run_id=run_id))
    # Set, not parsed: torchrun's parser would read the script's own --options (abbreviations included).
    parsed.training_script_args = target[1:]
    previous = signal.signal(signal.SIGUSR1, _forward_to_workers)
    try:
        torchrun.run(parsed)
    except ChildFailedError as err:
        rank, code = root_failure(err.failures)
        print(f"scaletrain: worker rank {rank} {_exit_text(code)} ({len(err.failures)} of "
              f"{cfg.nproc * cfg.nnodes} workers stopped with an error; see its output above)",
              file=sys.stderr)
        return 2 if code == 2 else 1
    except RendezvousError as err:
        why = " ".join(f"{err} {err.__cause__ or ''}".split())  # one line: the cause may span several
        where = cfg.rdzv_endpoint or "this machine"
        print(f"scaletrain: rendezvous at {where} failed ({type(err).__name__}: {why}); fix: check that "
              f"the endpoint is reachable from every machine and that all {cfg.nnodes} machines run the "
              "same command", file=sys.stderr)
        return 1
    except SignalException as err:
        if report_signal:
            print(f"scaletrain: stopped by {err.sigval.name}; the workers were stopped too", file=sys.stderr)
        return 128 + int(err.sigval)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return 0


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc; elsewhere none)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _forward_to_workers(signum: int, frame: object) -> None:
    """Slurm's --signal=USR1@T reaches every process of the step, but a user's `kill -USR1` reaches only this
    one, whose default action would end the agent and orphan the workers: pass it on to them instead. The
    workers treat it as preemption (save, exit 0)."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
