"""Where a run writes: chosen so that a finished run is never overwritten.

A run directory is finished when it holds summary.json. The default, runs/<run.name>, steps to
runs/<run.name>-2, -3, ... past finished runs; a directory the user names explicitly and that holds a
finished run is refused (exit 2) rather than overwritten.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

from scaletrain.checkpoint.commit import committed
from scaletrain.config import Config, check_run_dir
from scaletrain.errors import ConfigError
from scaletrain.runtime import Runtime, rank0_decides


def finished(path: Path) -> bool:
    return (path / "summary.json").is_file()


def _next_free(base: Path, taken: Callable[[Path], bool] = finished) -> Path:
    """``base``, or the first of base-2, base-3, ... that is not ``taken`` (by default: holds a finished run)."""
    path, n = base, 1
    while taken(path):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def choose_run_dir(cfg: Config) -> Config:
    """The config with run.dir set to the directory this run will write."""
    if cfg.run.dir:
        path = Path(cfg.run.dir)
        check_run_dir(path)
        if finished(path):
            raise ConfigError("run.dir", cfg.run.dir, f"a new or unfinished run directory ({path / 'summary.json'} "
                              "says this one finished)", f"--run.dir={_next_free(path)}, or remove {path} first"
                              + _further(path))
        return cfg
    check_run_dir(Path("runs") / cfg.run.name, "default: runs/<run.name>")
    path = _next_free(Path("runs") / cfg.run.name)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(path)))


def _further(path: Path) -> str:
    """The rest of a finished run directory's fix: how to train that run further (a larger train.max_steps or
    more epochs, as Lightning's fit(ckpt_path=...) does), from its latest checkpoint, in a directory of its own."""
    saved = committed(path / "checkpoints")
    if not saved:
        return ""
    return (f"; to train it further, add --run.dir={_next_free(path)} --checkpoint.resume={saved[-1][1]} with a "
            "larger train.max_steps or train.epochs")


LOCK = ".lock"
_held: dict[Path, int] = {}  # run directories this process writes: the open lock file of each


def hold_run_dir(path: Path) -> None:
    """Take the run directory for this process (rank 0 of a job), where it exists: an exclusive flock on
    RUN_DIR/.lock, or one line naming the run that holds it. Taken as the directory is agreed (before a resume
    looks at its checkpoints and clears staging directories: another run's live save) and again once created.
    Two runs writing one directory delete each other's checkpoints (each one's retention) and interleave
    metrics.jsonl; the kernel drops the lock when the process ends, killed or not, so a restarted or resumed run
    takes it again. Held again by the same process: nothing to do."""
    path = path.resolve()
    if path in _held or not path.is_dir():
        return  # a new directory: taken where the run creates it (services.py), so a refused run leaves none
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError("run.dir", str(path), f"a directory no other run is writing ({holder} holds "
                          f"{path / LOCK})", f"wait for that run to end, or --run.dir={_next_free(path, Path.exists)}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held[path] = fd


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the lock files: an flock belongs to the open file,
    which the child shares, so its copy would hold the lock after this process released it."""
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def release_run_dir(path: Path) -> None:
    """Let the run directory go (the run closed): another run, or this process's next, may take it."""
    fd = _held.pop(path.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the file drops its flock


def agree_run_dir(cfg: Config, rt: Runtime) -> Config:
    """Rank 0 chooses and takes the directory (hold_run_dir); every rank gets its choice, or its refusal (one
    object broadcast at start-up)."""
    def choose() -> str:
        chosen = choose_run_dir(cfg).run.dir
        hold_run_dir(Path(chosen))
        return chosen

    run_dir = rank0_decides(rt, choose)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir)))
