"""Where a run writes: chosen so that a finished run is never overwritten.

A run directory is finished when it holds summary.json. The default, runs/<run.name>, steps to
runs/<run.name>-2, -3, ... past finished runs; a directory the user names explicitly and that holds a
finished run is refused (exit 2) rather than overwritten.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from scaletrain.config import Config, check_run_dir
from scaletrain.errors import ConfigError
from scaletrain.runtime import Runtime, rank0_decides


def finished(path: Path) -> bool:
    return (path / "summary.json").is_file()


def _next_free(base: Path) -> Path:
    path, n = base, 1
    while finished(path):
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
                              "says this one finished)", f"--run.dir={_next_free(path)}, or remove {path} first")
        return cfg
    check_run_dir(Path("runs") / cfg.run.name, "default: runs/<run.name>")
    path = _next_free(Path("runs") / cfg.run.name)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(path)))


def agree_run_dir(cfg: Config, rt: Runtime) -> Config:
    """Rank 0 chooses; every rank gets its choice, or its refusal (one object broadcast at start-up)."""
    run_dir = rank0_decides(rt, lambda: choose_run_dir(cfg).run.dir)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir)))
