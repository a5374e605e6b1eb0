"""`scaletrain report LABDIR`: a lab's record (lab.json and its PNGs, labs/output.py) as one self-contained
report.html (its reading, its rows as a table, its figures inline) beside a report.json manifest, written the
way a run's report is: into LABDIR/report by default, never over a file that an earlier report did not write.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.errors import DataError
from scaletrain.labs.output import LAB_FILE, read_lab
from scaletrain.observe.report import _FORMAT, HTML, MANIFEST, _check_out, _write
from scaletrain.observe.report.html import _CSS

_FIX = "run the lab again (scaletrain lab NAME --out LABDIR)"


@dataclass
class LabReport:
    name: str
    rows: list[tuple[str, str]]
    out: Path
    notes: list[str]  # figures the record names that are not there


def is_lab(path: Path) -> bool:
    return (path / LAB_FILE).is_file()


def _checked(record: Any, path: Path) -> dict[str, Any]:
    """lab.json as labs/output.py writes it; anything else is one DataError naming the file."""
    where = path / LAB_FILE
    if not isinstance(record, dict) or not isinstance(record.get("lab"), str):
        raise DataError(where, "not a lab's record (no 'lab' name)", _FIX)
    for key in ("reading", "figures"):
        if not all(isinstance(s, str) for s in record.get(key) or []):
            raise DataError(where, f"'{key}' is not a list of strings", _FIX)
    if not all(isinstance(r, list) and len(r) == 2 for r in record.get("rows") or []):
        raise DataError(where, "'rows' is not a list of [name, value] pairs", _FIX)
    return record


def render(record: dict[str, Any], png: dict[str, bytes], source: Path) -> str:
    """The page: the lab's reading, its rows, then each figure inline (data: URIs, no external URL)."""
    e = html.escape
    env = record.get("environment") or {}
    title = f"scaletrain lab: {e(record['lab'])}"
    labels = {"cpu": "", "torch": "torch ", "date": ""}
    made = "".join(f"; {label}{e(str(env[k]))}" for k, label in labels.items() if env.get(k))
    head = f"<head><meta charset='utf-8'><title>{title}</title><style>{_CSS}</style></head>"
    command = e(str(env.get("command", "")))
    parts = [f"<!DOCTYPE html><html lang='en'>{head}<body>", f"<h1>{title}</h1>",
             f"<p class='caption'>From <code>{e(str(source))}</code>: <code>{command}</code>{made}.</p>",
             "<h2>Reading</h2>"]
    parts += [f"<p>{e(sentence)}</p>" for sentence in record.get("reading") or []]
    body = "".join(f"<tr><th>{e(str(name))}</th><td>{e(str(value))}</td></tr>"
                   for name, value in record["rows"])
    parts.append(f"<h2>Numbers</h2><table>{body}</table>")
    for name, data in png.items():
        stem = e(Path(name).stem)
        parts.append(f"<h2 id='{stem}'>{stem}</h2>")
        encoded = base64.b64encode(data).decode("ascii")
        parts.append(f"<img alt='{stem}' src='data:image/png;base64,{encoded}'>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_lab_report(path: Path, out: Path | None = None) -> LabReport:
    """Read LABDIR's lab.json and PNGs; write report.html and report.json into ``out`` (LABDIR/report)."""
    record = read_lab(path)
    if record is None:
        raise DataError(path, f"no {LAB_FILE} here (not a lab directory)", _FIX)
    record = _checked(record, path)
    out = out or path / "report"
    png, notes = {}, []
    for name in record.get("figures") or []:
        file = path / Path(name).name  # a name, never a path out of the lab directory
        if file.is_file():
            png[file.name] = file.read_bytes()
        else:
            notes.append(f"{file} is missing: the record names it")
    names = [HTML, MANIFEST]
    owned = _check_out(out, names)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / HTML, render(record, png, path).encode("utf-8"))
    manifest = {"format": _FORMAT, "files": names, "lab": record["lab"], "source": str(path),
                "rows": record["rows"]}
    _write(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
    for stale in owned - set(names):  # a run's report written here before
        (out / stale).unlink(missing_ok=True)
    return LabReport(record["lab"], [(str(n), str(v)) for n, v in record["rows"]], out, notes)
