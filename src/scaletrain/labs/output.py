"""What every lab leaves behind, in one layout `scaletrain report` reads: a directory holding ``lab.json``
(the lab's name, the machine header of bench/report.py, the command, a short reading in sentences, a table of
rows and every number behind them) and one PNG per figure. Plots use matplotlib's object API (``Figure``),
never pyplot, as the benchmarks' do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

LAB_FILE = "lab.json"


def lab_dir(out: str | None, lab: str) -> Path:
    """The directory a lab writes to (``--out``, default runs/lab-NAME), created; a path that is a file is one
    clear error."""
    from scaletrain.cli.options import out_dir

    path = Path(out) if out else Path("runs") / f"lab-{lab}"
    if path.exists() and not path.is_dir():
        raise UserError(f"--out = {str(path)!r}: a file, not a directory; fix: --out runs/lab-{lab}")
    return out_dir(path, "--out", f"runs/lab-{lab}")


def write_lab(out: Path, lab: str, *, reading: Sequence[str], rows: Sequence[tuple[str, str]],
              numbers: dict[str, Any], figures: dict[str, Any], command: Sequence[str] | None = None) -> Path:
    """lab.json and one PNG per figure (name -> matplotlib Figure, saved as NAME.png) in ``out``; returns the
    path of lab.json. ``reading``: sentences a reader can act on; ``rows``: (name, value) pairs for a table;
    ``numbers``: everything measured, JSON-able."""
    from scaletrain.bench.report import environment, write_json

    pngs = []
    for name, fig in figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        pngs.append(path.name)
    data = {"lab": lab, "environment": environment(command), "reading": list(reading),
            "rows": [list(r) for r in rows], "figures": pngs, "numbers": numbers}
    return write_json(out / LAB_FILE, data)


def read_lab(path: Path) -> dict[str, Any] | None:
    """A lab directory's lab.json, or None where ``path`` holds none."""
    file = path / LAB_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{file}: not a lab's record ({err}); fix: run the lab again with --out {path}") from None
