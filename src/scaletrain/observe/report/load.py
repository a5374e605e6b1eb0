"""Reading a run directory for the report: metrics.jsonl and summary.json, checked against docs/metrics.md,
and config.toml (for the schedule the learning-rate chart redraws).

A file that cannot be read as the contract says is the user's input, not our bug: it becomes a DataError
(one line: the path, what is wrong, the fix). Keys that a run simply does not have (an older run without
phase times, a run still in progress without summary.json) are not errors: the plots that need them are
left out with a note.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.config import tomllib
from scaletrain.errors import DataError

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.toml"
_KINDS = ("train", "eval", "checkpoint", "resume")
_SCALARS = ("loss", "lr", "samples_per_s", "samples_per_s_per_rank", "tokens_per_s", "step_time_s", "mfu",
            "flops_per_s")
# the evaluation's own names in summary.json's eval and metrics.jsonl's eval_* (fit()'s metrics= are the others)
EVAL_OWN = ("loss", "accuracy", "count", "correct")
_RUN_FIX = "pass a directory that 'scaletrain train' wrote (its --run.dir, e.g. runs/digits)"


@dataclass
class Run:
    """One run directory, parsed. Records keep their file order; ``name`` labels the run in legends."""

    path: Path
    name: str
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)  # checkpoint, resume
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None  # config.toml as written by the run: {section: {key: value}}

    @property
    def world_size(self) -> int | None:
        if self.summary and isinstance(self.summary.get("world_size"), int):
            return self.summary["world_size"]
        ranks = {len(v) for r in self.train for v in (r.get("phase_s") or {}).values()}
        return ranks.pop() if len(ranks) == 1 else None

    @property
    def ended(self) -> dict[str, Any] | None:
        """How the last attempt ended without a summary: its "failed" or "stopped" record (None: still
        running, or killed before it could say)."""
        for record in reversed(self.other):
            if record.get("kind") in ("failed", "stopped"):
                return record
            if record.get("kind") in ("start", "resume"):  # a later attempt began after it
                return None
        return None

    @property
    def global_batch(self) -> int | None:
        value = (self.summary or {}).get("global_batch")
        return value if isinstance(value, int) and value > 0 else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_ranked(record: dict[str, Any], key: str, where: str) -> None:
    """``{name: [one number per rank]}``, every list of one length (docs/metrics.md: lists indexed by rank)."""
    value = record.get(key)
    if value is None:
        return
    fix = f"{key} must be {{name: [a number per rank, ...]}} as docs/metrics.md says; rewrite or delete that line"
    if not isinstance(value, dict):
        raise DataError(where, f"{key} is {type(value).__name__}, not an object", fix)
    lengths = set()
    for name, per_rank in value.items():
        if not isinstance(per_rank, list) or not per_rank or not all(_is_number(v) for v in per_rank):
            raise DataError(where, f"{key}.{name} is not a non-empty list of numbers", fix)
        lengths.add(len(per_rank))
    if len(lengths) > 1:
        raise DataError(where, f"{key} lists have different lengths {sorted(lengths)} (one entry per rank)", fix)


def _check_record(record: Any, where: str) -> dict[str, Any]:
    fix = "rewrite or delete that line (every line is one JSON object as docs/metrics.md describes)"
    if not isinstance(record, dict):
        raise DataError(where, f"a JSON {type(record).__name__}, not an object", fix)
    kind = record.get("kind")
    if not isinstance(kind, str):
        raise DataError(where, f"kind is {kind!r}, expected a string ({', '.join(_KINDS)}, ...)", fix)
    if kind not in _KINDS:
        return record  # a kind added after this report was written (keys and kinds are only ever added)
    if not (isinstance(record.get("step"), int) and not isinstance(record["step"], bool)):
        raise DataError(where, f"a {kind} record without an integer 'step'", fix)
    for key, value in record.items():
        # Scalars the plots read: a string where a number belongs would fail deep inside matplotlib.
        if (key in _SCALARS or key.startswith("eval_")) and not _is_number(value):
            raise DataError(where, f"{key} is {value!r}, not a number", fix)
    _check_ranked(record, "phase_s", where)
    mem = record.get("mem")
    if mem is not None:
        if not isinstance(mem, dict):
            raise DataError(where, "mem is not an object", fix)
        if "rank_peak_bytes" in mem:
            _check_ranked({"mem": {"rank_peak_bytes": mem["rank_peak_bytes"]}}, "mem", where)
        for key in ("peak_bytes", "params_bytes", "grads_bytes", "optim_bytes", "activations_bytes"):
            if key in mem and not _is_number(mem[key]):
                raise DataError(where, f"mem.{key} is {mem[key]!r}, not a number", fix)
    return record


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl, checked; blank lines are skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                # A run killed while writing can leave a partial last line.
                raise DataError(where, f"not valid JSON ({err.msg} at column {err.colno})",
                                "repair or delete that line (a run killed mid-write leaves a partial last "
                                "line)") from None
            records.append(_check_record(record, where))
    return records


def read_summary(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(path, f"not valid JSON ({err})", f"restore it or delete it (the report then uses "
                        f"{METRICS} alone)") from None
    if not isinstance(summary, dict):
        raise DataError(path, f"a JSON {type(summary).__name__}, not an object", "restore it or delete it")
    return summary


def read_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise DataError(path, f"not valid TOML ({err})", "restore it or delete it (the learning-rate chart "
                        f"then shows the lr logged in {METRICS} alone)") from None


def load_run(path: Path, name: str | None = None) -> Run:
    """Parse one run directory; DataError for anything that is not a readable run."""
    if not path.exists():
        raise DataError(path, "no such directory", _RUN_FIX)
    if not path.is_dir():
        hint = f"pass its directory, {path.parent}" if path.name in (METRICS, SUMMARY) else _RUN_FIX
        raise DataError(path, "is a file, not a run directory", hint)
    metrics = path / METRICS
    if not metrics.is_file():
        raise DataError(path, f"no {METRICS} here (not a run directory, or the run has not started)", _RUN_FIX)
    run = Run(path=path, name=name or path.name, summary=read_summary(path / SUMMARY),
              config=read_config(path / CONFIG))
    for record in read_metrics(metrics):
        {"train": run.train, "eval": run.eval}.get(record["kind"], run.other).append(record)
    if not run.train and not run.eval:
        raise DataError(metrics, "holds no train or eval records", "let the run log at least once "
                        "(--train.log_every sets how often), or pass another run")
    return run


def run_names(paths: list[Path]) -> list[str]:
    """Legend names: each directory's name, with as much of its parent path as it takes to tell them apart."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        # Distinct directories that still share a name need more of their path; the same one given twice never.
        if len(set(names)) == len(set(parts)) or depth >= max(len(p) for p in parts):
            break
        depth += 1
    # The same directory given twice: number the repeats so each legend entry is still its own.
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def finite(values: list[Any]) -> bool:
    return any(_is_number(v) and math.isfinite(v) for v in values)
