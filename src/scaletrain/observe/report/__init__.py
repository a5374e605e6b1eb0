"""`scaletrain report`: plots and a summary table from one or more run directories (docs/observe.md).

    report = write_report([Path("runs/a"), Path("runs/b")], Path("out"))
    report.charts[0].data   # the numbers the loss plot drew, by legend label

The output directory gets report.html (self-contained), one PNG per chart that could be drawn, and
report.json (what was drawn, and the list of files this report owns). Nothing else is ever overwritten:
a file of the same name that an earlier report did not write is refused with a DataError.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.errors import DataError
from scaletrain.observe.report.charts import CHART_NAMES, Chart, all_charts
from scaletrain.observe.report.html import render
from scaletrain.observe.report.load import Run, load_run, run_names
from scaletrain.observe.report.summary import summary_rows

MANIFEST = "report.json"
HTML = "report.html"
_FORMAT = "scaletrain-report/1"
OUTPUTS = frozenset({HTML, MANIFEST, *(f"{name}.png" for name in CHART_NAMES)})


@dataclass
class Report:
    runs: list[Run]
    rows: list[tuple[str, list[str]]]
    charts: list[Chart]
    out: Path
    files: list[Path]  # everything written, report.html first

    def chart(self, name: str) -> Chart:
        return next(c for c in self.charts if c.name == name)


def load_runs(paths: list[Path]) -> list[Run]:
    return [load_run(p, n) for p, n in zip(paths, run_names(paths))]


def default_out(paths: list[Path]) -> Path:
    """RUN/report for one run; RUN_A/report-vs-B[-C...] when comparing, beside the first run's own files."""
    if len(paths) == 1:
        return paths[0] / "report"
    return paths[0] / ("report-vs-" + "-".join(p.resolve().name for p in paths[1:]))


def _owned(out: Path) -> set[str]:
    """Names an earlier report wrote here (from its manifest); a manifest we did not write owns nothing."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return set()
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return set()
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("files"), list):
        return set()
    # Only names a report can write: a hand-edited manifest must not make us delete a run's own files.
    return {f for f in data["files"] if f in OUTPUTS}


def _check_out(out: Path, names: list[str]) -> set[str]:
    if out.exists() and not out.is_dir():
        raise DataError(out, "is a file, not a directory", "--out a directory (it is created if missing)")
    owned = _owned(out)
    for name in names:
        if (out / name).exists() and name not in owned:
            raise DataError(out / name, "exists and was not written by scaletrain report",
                            "--out a new directory, or move that file away")
    return owned


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _png(chart: Chart) -> bytes:
    buf = io.BytesIO()
    # No "Software" text chunk: the file then names no URL and is the same bytes for the same data.
    chart.figure.savefig(buf, format="png", metadata={"Software": None})  # type: ignore[union-attr]
    return buf.getvalue()


def _manifest(runs: list[Run], rows: list[tuple[str, list[str]]], charts: list[Chart],
              files: list[str]) -> dict[str, Any]:
    return {"format": _FORMAT, "files": files,
            "runs": [{"name": r.name, "path": str(r.path)} for r in runs],
            "summary": {name: values for name, values in rows},
            "charts": {c.name: {"file": f"{c.name}.png" if c.figure is not None else None, "title": c.title,
                                "note": c.note, "data": c.data} for c in charts}}


def write_report(paths: list[Path], out: Path | None = None) -> Report:
    """Read the runs, draw, and write report.html, the PNGs and report.json into ``out``."""
    runs = load_runs(paths)
    out = out or default_out(paths)
    charts = all_charts(runs)
    rows = summary_rows(runs)
    drawn = [c for c in charts if c.figure is not None]
    names = [HTML, *(f"{c.name}.png" for c in drawn), MANIFEST]
    owned = _check_out(out, names)
    out.mkdir(parents=True, exist_ok=True)
    png = {c.name: _png(c) for c in drawn}
    for name, data in png.items():
        _write(out / f"{name}.png", data)
    _write(out / HTML, render(runs, rows, charts, png).encode("utf-8"))
    _write(out / MANIFEST, (json.dumps(_manifest(runs, rows, charts, names), indent=1) + "\n").encode("utf-8"))
    for stale in owned - set(names):  # a chart an earlier report drew and this one could not
        (out / stale).unlink(missing_ok=True)
    return Report(runs, rows, charts, out, [out / n for n in names])
