"""User-facing errors: each becomes one line on stderr and exit code 2, never a traceback.

Internal invariants use ``assert``; anything a user can cause by their input (a config key, a value,
a file) raises one of these with what was wrong, what is allowed and how to fix it.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, TypeVar

from scaletrain.env import FAILURE_SAID, USAGE_SAID, launcher_env_problem, tell_launcher, under_launcher

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILURE = 1  # training failed (a crash, a non-finite loss)
EXIT_USAGE = 2  # usage or configuration error


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Unpickle one of our errors whatever its __init__ takes (errors travel between ranks as objects)."""
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class Reported(Exception):
    """An error scaletrain reports as one line. ``agreed``: every rank raised this same error from one
    decision (rank 0's, broadcast), so rank 0 alone reports it."""

    agreed = False

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)


class TrainingFailed(Reported):
    """Training cannot go on (exit code 1): a non-finite loss, a failed collective, out of memory."""


class DiskFull(TrainingFailed):
    """A write that found its disk full (ENOSPC, or a quota), or a file larger than the process may write (EFBIG:
    `ulimit -f`, the filesystem's largest file): the path, the bytes it was going to write and the bytes free.
    ``outcome`` says what stays on disk (the latest checkpoint, what else was written)."""

    def __init__(self, path: Any, needed: int, free: int, outcome: str = "", code: int = errno.ENOSPC) -> None:
        said = f"; {outcome}" if outcome else ""
        if code == errno.EFBIG:
            text = (f"file too large: {path} needs {needed:,} bytes, past this process's file size limit (ulimit -f) "
                    f"or the largest file its filesystem takes{said}; fix: raise the limit (ulimit -f unlimited), "
                    "or point --run.dir at another filesystem")
        else:
            text = (f"disk full: {path} needs {needed:,} bytes, {free:,} free{said}; fix: free space on that disk, "
                    "or point --run.dir at a larger one")
        super().__init__(text)
        self.path, self.needed, self.free, self.outcome, self.code = path, needed, free, outcome, code

    @classmethod
    def at(cls, path: Path, needed: int, outcome: str = "", err: BaseException | None = None) -> DiskFull:
        """The error for ``path``, with the bytes free there now (after the failed write was cleaned up); ``err``,
        the write's own error, tells a full disk from a file too large."""
        return cls(path, needed, free_bytes(path), outcome, refused(err) or errno.ENOSPC)

    def then(self, outcome: str) -> DiskFull:
        """The same error, saying what stays on disk."""
        return DiskFull(self.path, self.needed, self.free, outcome, self.code)


def free_bytes(path: Path) -> int:
    """Bytes this process may still write on the filesystem of ``path`` (or of its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the write cannot go on until the user makes room


def refused(err: BaseException | None) -> int:
    """The errno (ENOSPC, EDQUOT or EFBIG) of a write refused for its size: an OSError, one that caused ``err``,
    or one a library wrapped in its own error's message (safetensors says "... (os error 28)", DCP quotes each
    rank's "[Errno 28] ..."); 0 for anything else."""
    if err is None:
        return 0
    if isinstance(err, DiskFull):
        return err.code
    if isinstance(err, OSError) and err.errno in _REFUSED:
        return err.errno
    said = str(err)
    for code in _REFUSED:
        if f"(os error {code})" in said or f"[Errno {code}]" in said:
            return code
    return refused(err.__cause__ or err.__context__)


def is_disk_full(err: BaseException | None) -> bool:
    """A write refused for its size (refused): a full disk, a quota, a file too large."""
    return refused(err) != 0


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving a checkpoint, and said so: uncaught, it ends the program
    without a traceback. Ctrl-C exits 130 as Ctrl-C does (a worker under a launcher exits 0, so that its agent
    does not take the stop for a failure and restart the group); a preemption exits 0."""

    @property
    def exit_code(self) -> int:
        return 0 if "RANK" in os.environ else 130


class UserError(Reported):
    """A mistake in the user's input. ``str(err)`` is the whole one-line message."""


class ConfigError(UserError):
    """A config key or value that cannot be used."""

    def __init__(self, key: str, value: Any, expected: str, fix: str, origin: str = "") -> None:
        where = f" ({origin})" if origin else ""
        super().__init__(f"{key} = {value!r}{where}: expected {expected}; fix: {fix}")
        self.key, self.value, self.expected, self.fix, self.origin = key, value, expected, fix, origin

    def at(self, origin: str) -> ConfigError:
        """The same error, saying where the value came from."""
        return ConfigError(self.key, self.value, self.expected, self.fix, origin)


class DataError(UserError):
    """A data file or directory that is missing or malformed."""

    def __init__(self, path: Any, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}; fix: {fix}")
        self.path = path


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, damaged, tampered with, or for another model."""

    def __init__(self, path: Any, problem: str, fix: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}; fix: {fix}")
        self.path, self.problem = path, problem


# ------------------------------------------------------------------------------------------- reporting


def few(names: list[str], most: int = 4) -> str:
    """The first ``most`` of ``names`` for a one-line message, and how many more: "a, b, c and 23 more"."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def exit_code(err: BaseException) -> int:
    return EXIT_USAGE if isinstance(err, UserError) else EXIT_FAILURE


def one_line(err: BaseException) -> str:
    """How scaletrain says ``err``: ``scaletrain: error: ...`` (exit 2) or ``scaletrain: training failed: ...``."""
    what = "error" if isinstance(err, UserError) else "training failed"
    return f"scaletrain: {what}: {err}"


def said_of(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name when it has none): torch's words inside one of ours."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def first_line(err: BaseException) -> str:
    """``err`` in one line for a record or a warning: scaletrain's own message (one line already), another's
    type and the first line of its message."""
    text = str(err) if isinstance(err, Reported) else f"{type(err).__name__}: {err}"
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def _job_env() -> dict[str, str]:
    """This process's place in the job: the launcher's variables, or (a task of an srun step that has not set
    them yet, as a usage error found before the run starts leaves it) those env.py adopt_slurm_task would set."""
    from scaletrain.env import adopt_slurm_task

    environ = dict(os.environ)
    adopt_slurm_task(environ)
    return environ


def _first_to_say(line: str, environ: dict[str, str]) -> tuple[bool, Callable[[], None]]:
    """Under a launcher, True for the first rank of the job to report this line, through a key-value store on
    the job's MASTER_PORT, so an error every rank raised is said once: torchrun's agent keeps one up for the
    whole job; where no agent does (srun's tasks, each a worker or an agent of its own), rank 0 opens one for
    the others to count in (and a group already formed has its own there), and waits for them a few seconds,
    since `srun --kill-on-bad-exit` ends every task as soon as one exits: the second value waits, to be called
    once the line is out. Without a reachable store every rank says it."""
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return True, lambda: None
    try:
        import time
        from datetime import timedelta

        import torch.distributed as dist

        rank, world = int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
        store, hosting = None, False
        if rank == 0 and "TORCHELASTIC_RUN_ID" not in environ:  # no agent's store: this rank's own
            from scaletrain.cluster.torchrun import _bound  # listening on that address, not every interface

            try:
                store = _bound(dist.TCPStore)(addr, int(port), is_master=True, wait_for_workers=False,
                                              timeout=timedelta(seconds=5))
                hosting = True
            except Exception:  # noqa: BLE001 -- the port is taken: the group's own store, which serves as well
                store = None
        if rank != 0:
            time.sleep(0.3)  # rank 0 first: an error every rank raised is said without a rank prefix
        if store is None:
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=5))
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"scaletrain/said/{attempt}/{hashlib.sha256(line.encode()).hexdigest()[:16]}"
        first = int(store.add(key, 1)) == 1

        def linger() -> None:  # the others count themselves in before this store goes with this process
            deadline = time.monotonic() + 3.0
            while hosting and int(store.add(key, 0)) < world and time.monotonic() < deadline:
                time.sleep(0.05)

        return first, linger
    except Exception:  # noqa: BLE001 -- the store is gone or unreachable: say it rather than lose it
        return True, lambda: None


def report(err: BaseException, stream: TextIO | None = None) -> int:
    """Say ``err`` in one line, once per job however many ranks raised it; returns its exit code.

    Rank 0 alone reports an ``agreed`` error; any other is reported by the first rank to reach the job's
    store with that text (prefixed with its rank when that is not rank 0)."""
    stream = stream or sys.stderr
    environ = _job_env()
    line = one_line(err)
    if exit_code(err) == EXIT_USAGE:  # `scaletrain launch` takes a worker's exit 2 for this line only if said
        tell_launcher(USAGE_SAID)
    elif isinstance(err, TrainingFailed):  # the launcher's own line would name the first rank to exit instead
        tell_launcher(FAILURE_SAID, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if launcher_env_problem(environ) is None and under_launcher(environ) and environ["WORLD_SIZE"] != "1":
        rank = int(environ["RANK"])
        if getattr(err, "agreed", False) and rank != 0:
            return exit_code(err)
        first, linger = _first_to_say(line, environ)
        if first:
            print(line if rank == 0 else f"[rank {rank}] {line}", file=stream, flush=True)
        linger()
        return exit_code(err)
    print(line, file=stream, flush=True)
    return exit_code(err)


def says_errors(fn: F) -> F:
    """A library entry point (fit, plan_fit) whose scaletrain errors, uncaught by its caller, end the program
    as the CLI's do (install_excepthook); the caller can still catch them."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (Reported, Stopped):
            install_excepthook()
            raise

    return wrapper  # type: ignore[return-value]


def install_excepthook() -> None:
    """Make a scaletrain error that nobody catches end the program as the CLI does: one line (said once per
    job) and exit code 2 (1 for a training failure) instead of a traceback; a Stopped run exits as Ctrl-C
    does (it said why itself). Any other exception goes to the
    hook that was there before. Call it when such an error is on its way out: torch's init_process_group
    wraps the hook it finds in one that buffers stderr, which would swallow the line, so ours must be the
    outermost."""
    current = sys.excepthook
    if getattr(current, "_scaletrain", False):
        return

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if isinstance(err, Reported):
            sys.exit(report(err))  # SystemExit from an excepthook sets the exit code (atexit still runs)
        if isinstance(err, Stopped):
            sys.exit(err.exit_code)
        current(kind, err, tb)

    hook._scaletrain = True  # type: ignore[attr-defined]
    sys.excepthook = hook
