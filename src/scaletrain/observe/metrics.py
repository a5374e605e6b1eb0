"""metrics.jsonl (one object per log interval or evaluation) and summary.json, written by rank 0 only.

A full disk at either is DiskFull (one line: the file, the bytes it needed, the bytes free), after closing
what was half written: metrics.jsonl keeps every whole record before the failed one (a cut-short last line is
dropped at the next resume), and summary.json is written whole or not at all."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.errors import DiskFull, is_disk_full
from scaletrain.observe.memory import peak_bytes as peak_memory_bytes  # noqa: F401  (moved; the old name stays)


class MetricsWriter:
    """Appends one JSON object per line. Written at log and eval steps only, never every step."""

    def __init__(self, path: Path | None, *, append: bool = False, sinks: list[Any] | None = None) -> None:
        mode = "a" if append else "w"
        self.path = path
        self._file = open(path, mode, encoding="utf-8") if path is not None else None  # noqa: SIM115
        self.sinks = sinks or []  # more writers of the same records (observe/sinks.py)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            line = json.dumps({**record, "time": round(time.time(), 3)}) + "\n"  # when: the goodput account
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as err:
                if not is_disk_full(err):
                    raise
                self._abandon()
                raise DiskFull.at(self.path, len(line.encode()), err=err) from None
        for sink in self.sinks:
            sink.write(record)

    def _abandon(self) -> None:
        """Close the file after a failed write without trying that write again (close would flush it)."""
        assert self._file is not None
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass  # the descriptor is closed all the same

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def write_json(path: Path, data: dict[str, Any]) -> None:
    text = (json.dumps(data, indent=2) + "\n").encode()
    write_whole(path, len(text), lambda tmp: tmp.write_bytes(text))


def write_whole(path: Path, needed: int, write: Callable[[Path], object]) -> None:
    """``write(tmp)``, then rename tmp to ``path``: the file is there whole or not at all. A full disk
    removes what was half written and raises DiskFull naming ``path`` and ``needed`` (bytes)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except Exception as err:
        tmp.unlink(missing_ok=True)
        if not is_disk_full(err):
            raise
        raise DiskFull.at(path, needed, err=err) from None
    tmp.replace(path)


def read_records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's whole records (a line cut short by a crash is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
