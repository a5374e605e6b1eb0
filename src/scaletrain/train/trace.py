"""Per-step fingerprints of the whole training state, for `scaletrain verify-resume` (debug.trace).

After every optimizer step each rank appends one JSON line to RUN_DIR/trace/rank-NNNNN.jsonl: a digest of
the values logged since the last log step (this rank's, exact), the learning rate, SHA-256 digests of the batch it trained on and of
the state after the step (weights, optimizer, every RNG, LR schedule, loader position), and the batch's
sample indices. A resumed run also writes one ``"event": "resume"`` line with the state as loaded, which
must equal the uninterrupted run's state after that step; a new run one ``"event": "start"`` line (step 0) with
the state it starts from, which two runs of a reproducible job share. Costs a host sync and a pass over the state
every step: a verification tool, off by default.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

PARTS = ("weights", "optimizer", "rng", "scheduler", "data")


def _digest_tree(node: Any, h: Any) -> None:
    if isinstance(node, torch.Tensor):
        t = node.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(node, dict):
        for k in sorted(node, key=str):
            h.update(str(k).encode())
            _digest_tree(node[k], h)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _digest_tree(v, h)
    else:
        h.update(repr(node).encode())


def digest(node: Any) -> str:
    h = hashlib.sha256()
    _digest_tree(node, h)
    return h.hexdigest()[:16]


class TraceFile:
    """One rank's trace file (a session's: train/session.py, for fit() too): the digest of the step's batches and their
    sample indices as they are drawn, and one JSON line per step or resume."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        folder = run_dir / "trace"
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / f"rank-{rank:05d}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._data = hashlib.sha256()
        self._indices: list[int] = []

    def batch_drawn(self, tensors: Iterable[torch.Tensor], indices: list[int]) -> None:
        for t in tensors:
            self._data.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self._indices += indices

    def drawn(self) -> dict[str, Any]:
        """The step's ``data`` digest and ``indices``, and a fresh start for the next step."""
        out = {"data": self._data.hexdigest()[:16], "indices": self._indices}
        self._data, self._indices = hashlib.sha256(), []
        return out

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
