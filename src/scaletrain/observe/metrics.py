"""metrics.jsonl (one object per log interval or evaluation) and summary.json, written by rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scaletrain.observe.memory import peak_bytes as peak_memory_bytes  # noqa: F401  (moved; the old name stays)


class MetricsWriter:
    """Appends one JSON object per line. Written at log and eval steps only, never every step."""

    def __init__(self, path: Path | None, *, append: bool = False, sinks: list[Any] | None = None) -> None:
        mode = "a" if append else "w"
        self._file = open(path, mode, encoding="utf-8") if path is not None else None  # noqa: SIM115
        self.sinks = sinks or []  # more writers of the same records (observe/sinks.py)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
