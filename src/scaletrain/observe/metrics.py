"""metrics.jsonl (one object per log interval or evaluation) and summary.json, written by rank 0 only."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


class MetricsWriter:
    """Appends one JSON object per line. Written at log and eval steps only, never every step."""

    def __init__(self, path: Path | None) -> None:
        self._file = open(path, "w", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on a GPU, peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
