"""``scaletrain train`` as a subprocess, and what its run directory says about speed.

Used by ``bench scaling`` and by benchmarks/ (the peer comparison, the DDP bucket sweep): they measure the
trainer exactly as a user runs it, through the CLI and its launcher, and read the numbers the run recorded
(docs/metrics.md) rather than timing it from outside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError


class RunFailed(Exception):
    """A training run exited with an error (not a usage error: those are re-raised as UserError)."""

    def __init__(self, command: Sequence[str], code: int, log: Path) -> None:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log.is_file() else []
        super().__init__(f"'{' '.join(command[2:])}' exited with code {code}; its log {log} ends with:\n  "
                         + "\n  ".join(tail))
        self.code, self.log = code, log


@dataclass
class TrainRun:
    nproc: int
    run_dir: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]  # metrics.jsonl's kind="train" records, in order


def train_command(recipe: str, nproc: int, run_dir: Path, overrides: Mapping[str, Any]) -> list[str]:
    return [sys.executable, "-m", "scaletrain", "train", recipe, f"--nproc={nproc}", f"--run.dir={run_dir}",
            *(f"--{key}={value}" for key, value in overrides.items())]


def run_training(recipe: str, nproc: int, run_dir: Path, overrides: Mapping[str, Any], *, threads: int,
                 timeout_s: float = 3600) -> TrainRun:
    """Train with ``threads`` intra-op threads per rank; its output goes to <run_dir>.log."""
    command = train_command(recipe, nproc, run_dir, overrides)
    # The launcher only sets OMP_NUM_THREADS where it is unset, so this value reaches every rank.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = run_dir.with_name(run_dir.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                              check=False)
    if proc.returncode == 2:  # a usage error: the run's own one line is the whole story
        lines = [ln for ln in log.read_text().splitlines() if "scaletrain: error: " in ln]
        if lines:
            raise UserError(lines[-1].split("scaletrain: error: ", 1)[1])
    if proc.returncode != 0:
        raise RunFailed(command, proc.returncode, log)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return TrainRun(nproc, run_dir, summary, [r for r in records if r.get("kind") == "train"])
