"""Workers of scaletrain's own commands forked from the launcher, where that is safe, instead of started as
new interpreters.

torchrun starts every worker as `python -u -m scaletrain ...`: a fresh interpreter that imports torch, its
compiler stack (any optimizer's first step imports torch._dynamo) and scaletrain again, some 2.5-3 s of CPU
per worker and per restart, which the launcher (whose own command line parsed and checked the same config)
has imported already. On a machine without CUDA devices a worker running scaletrain's own module is instead a
fork of the launcher, set up as that interpreter would start: its own session and process group, the
worker's environment, SIGKILLed with the launcher, signal handlers, standard streams (unbuffered, as `-u`),
torch's thread count (OMP_NUM_THREADS) and default random seed. It is the same child of the agent, waited for,
signalled and restarted the same way.

Only from a launcher that has computed on one thread since it started (serial_launcher): GNU OpenMP cannot
run in a child forked from a process that ran a parallel region, the child hangs at its first one (pytorch
issue 17199; so does MKL's matrix product on its threads). Never with CUDA devices: the launcher's own
checks (torch.cuda.is_available) may have initialized the driver, which a forked process cannot use. Only
scaletrain's own modules (OWN_MODULES: the trainer's `-m scaletrain`, the doctor's self-test, the rehearsal's
network check), never a user's script or module (`scaletrain launch script.py`): it runs as torchrun runs it,
in an interpreter that holds none of the launcher's state (logging handlers, warnings filters, atexit).
SCALETRAIN_WORKER_START=exec starts every worker as a new interpreter.
"""

from __future__ import annotations

import importlib
import io
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn

START_ENV = "SCALETRAIN_WORKER_START"  # "exec": every worker a new interpreter; default "auto"
# What every worker of scaletrain's imports (an optimizer's first step imports torch._dynamo), imported once by
# the launcher before its first fork instead of once by each worker.
PRELOAD = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "scaletrain.train.run")
# A fresh process's torch generator is seeded with c10's default_rng_seed_val.
_TORCH_DEFAULT_SEED = 67280421310721


def check_start() -> None:
    """SCALETRAIN_WORKER_START holds a value it can take (else one line, exit 2)."""
    from scaletrain.errors import ConfigError

    value = os.environ.get(START_ENV, "auto")
    if value not in ("auto", "exec"):
        raise ConfigError(START_ENV, value, "auto (fork the launcher where safe) or exec (a new interpreter per "
                          "worker)", f"unset {START_ENV}, or {START_ENV}=exec")


_serial = False  # serial_launcher() was called: this process has computed on one thread only since


def _allowed() -> bool:
    """Linux, not turned off, and no CUDA device here (asked without initializing CUDA: a CPU build of torch has
    none to count, and a CUDA build counts them through NVML)."""
    if not sys.platform.startswith("linux") or os.environ.get(START_ENV, "auto") == "exec":
        return False
    import torch

    return not (torch.backends.cuda.is_built() and torch.cuda.device_count() > 0)


def serial_launcher() -> None:
    """Called by a command that starts workers, before it computes anything (its checks build the datasets):
    where its workers can be forks of it, this process computes on one thread from here on (can_fork). The
    workers get their own thread count back (OMP_NUM_THREADS)."""
    global _serial
    if _allowed():
        import torch

        torch.set_num_threads(1)
        _serial = True


def can_fork() -> bool:
    """Whether this launcher may fork its workers: allowed here, and on one thread since serial_launcher()."""
    import torch

    return _serial and torch.get_num_threads() == 1 and not torch.cuda.is_initialized() and _allowed()


# The modules of scaletrain's own a launcher runs as its workers (`python -u -m MODULE ARGS`): the trainer's
# commands, the doctor's all-reduce self-test and the rehearsal's network check. A new interpreter each cost the
# doctor's and the rehearsal's 2 to 4 ranks some 2.5 s of CPU apiece, most of a 16 s rehearsal's start-up.
OWN_MODULES = ("scaletrain", "scaletrain.cluster.doctor", "scaletrain.cluster.rehearse_net")


def own_module(args: Sequence[str]) -> tuple[str, list[str]] | None:
    """(module, the arguments after it) when ``args`` (as torchrun starts a worker) runs one of scaletrain's own
    modules (OWN_MODULES) with this interpreter; None for anything else."""
    head = [sys.executable, "-u", "-m"]
    if list(args[:len(head)]) != head or len(args) == len(head) or args[len(head)] not in OWN_MODULES:
        return None
    return str(args[len(head)]), [str(a) for a in args[len(head) + 1:]]


class Worker:
    """A forked worker as torchrun's agent uses a subprocess.Popen: pid, poll(), wait(), send_signal()."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: its status is lost, as Popen then says
                self.returncode = 0
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._reap(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(args: Sequence[str], module: str, argv: list[str], env: dict[str, str], stdout: IO[Any] | None,
          stderr: IO[Any] | None, arm: Callable[[], None] | None) -> Worker:
    """Fork a worker that runs `python -m MODULE ARGV` (one of OWN_MODULES) in ``env`` (``args``: the command
    torchrun would have run);
    ``stdout``/``stderr``: files its streams go to (None: this process's); ``arm``: run first in the child
    (env.dies_with's request to die with this process)."""
    for name in PRELOAD:
        importlib.import_module(name)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what this process buffered is written once, by itself
    with warnings.catch_warnings():
        # Python 3.12+ warns of fork in a process with threads (the agent's store and keep-alive): the child
        # runs none of their code and takes none of their locks
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return Worker(pid, args)
    code = 1
    try:  # the child: from here on it leaves only through os._exit
        os.setsid()  # its own process group, as torchrun's start_new_session: the agent stops it with killpg
        if arm is not None:
            arm()
        _as_a_new_interpreter(env, stdout, stderr)
        import runpy

        sys.argv = ["-m", *argv]  # runpy puts the module's path first (scaletrain/__main__.py), as `-m` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = exit_code(done)
    except BaseException:  # noqa: BLE001 -- what a new interpreter prints for an uncaught exception
        traceback.print_exc()
    finally:
        leave(code)


def exit_code(done: SystemExit) -> int:
    """The exit code Python gives an uncaught SystemExit: None 0, an int itself, anything else printed to stderr
    and 1."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def leave(code: int) -> NoReturn:
    """A forked child's exit: its standard streams flushed, then os._exit, without the interpreter's teardown
    (which in a fork writes to the parent's pages, and may run the parent's atexit handlers)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def reseed_as_new() -> None:
    """The random generators a new interpreter starts with: torch's default seed, numpy's drawn from the OS."""
    import torch

    torch.manual_seed(_TORCH_DEFAULT_SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _as_a_new_interpreter(env: dict[str, str], stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
    """Undo what the launcher's process set up that a new `python -u -m scaletrain` would not have."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for target, fd in ((stdout, 1), (stderr, 2)):
        if target is not None:
            os.dup2(target.fileno(), fd)
    # -u: unbuffered binary streams, text written through at once
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                            errors=old.errors, write_through=True))
    os.environ.clear()
    os.environ.update(env)
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by OpenMP when torch loaded, in the launcher's environment
        torch.set_num_threads(int(threads))
    reseed_as_new()
