"""What every benchmark result carries and how it is shown: the machine header, JSON, a rich table, a PNG.

A number without its machine, versions, date and command is not evidence (STYLE.md, habit 9), so every
JSON a bench writes starts with ``environment()``. Plots use matplotlib's object API (``Figure``), never
pyplot: no global figure registry and no display backend, so they render the same on a headless machine.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from scaletrain.errors import UserError


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask, where the OS has one), not the host's total."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _invoked() -> list[str]:
    """This process's command as its user typed it: ``python script.py ...`` for a script (a benchmark under
    benchmarks/ recorded itself as ``scaletrain ...``), else ``scaletrain ...`` (the console script, or python -m
    scaletrain)."""
    first = sys.argv[0] if sys.argv else ""
    if first.endswith(".py") and Path(first).name != "__main__.py":
        return ["python", first, *sys.argv[1:]]
    return ["scaletrain", *sys.argv[1:]]


def environment(command: Sequence[str] | None = None) -> dict[str, Any]:
    """Machine, versions, date and command: the header of every benchmark result."""
    from scaletrain import __version__

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(command if command is not None else _invoked()),
        "host": platform.node(), "platform": platform.platform(), "cpu": _cpu_model(),
        "cores": usable_cores(), "python": platform.python_version(), "torch": torch.__version__,
        "scaletrain": __version__, "cuda": torch.version.cuda, "gpus": [],
    }
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return env


def header_line(env: dict[str, Any]) -> str:
    gpus = f" | {len(env['gpus'])} x {env['gpus'][0]}" if env["gpus"] else ""
    return (f"{env['cpu']} ({env['cores']} cores){gpus} | torch {env['torch']} | scaletrain {env['scaletrain']} "
            f"| {env['date']}")


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write whole or not at all (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def check_output_path(path: str | None, flag: str, suffix: str) -> None:
    """Fail before a long benchmark, not after it, when its result could not be written."""
    if not path:
        return
    parent = Path(path).parent
    if not parent.is_dir():
        raise UserError(f"{flag} = {path!r}: expected a file in an existing directory ({parent} is not one); "
                        f"fix: mkdir -p {parent}, or {flag} results{suffix}")
    if not path.endswith(suffix):
        raise UserError(f"{flag} = {path!r}: expected a {suffix} file name; fix: {flag} {Path(path).stem}{suffix}")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                sections: Sequence[int] = (), caption: str = "") -> None:
    """A rich table on stdout; numbers right-aligned; a rule before each row index in ``sections``."""
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for i, row in enumerate(rows):
        table.add_row(*row, end_section=i + 1 in sections)
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # a file or a pipe: rich would fold the table to 80 columns
        console = Console(highlight=False, soft_wrap=True, width=200)
    console.print(table)
    if caption:  # below the table, unwrapped: a caption would be folded to the table's width
        console.print(caption, markup=False)


def line_plot(path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
              xlabel: str, ylabel: str, logx: bool = False, logy: bool = False,
              xticks: tuple[Sequence[float], Sequence[str]] | None = None,
              reference: tuple[Sequence[float], Sequence[float], str] | None = None) -> Path:
    """One PNG: a line with markers per series (label -> (xs, ys)); ``reference`` is a dashed (xs, ys, label)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if reference is not None:
        ax.plot(reference[0], reference[1], linestyle="--", color="gray", label=reference[2])
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if xticks is not None:
        ax.set_xticks(list(xticks[0]), list(xticks[1]), rotation=45, ha="right")
        ax.minorticks_off()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
