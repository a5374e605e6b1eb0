"""--log.trace: every rank's phase timeline as one Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev).

The step timer (observe/timing.py) already marks each step's phases; with a Timeline attached it also keeps
them as spans. At each log step a rank appends the interval's spans to RUN_DIR/timeline/rank-NNNNN.jsonl (one
JSON array per line, so a crash loses at most one interval), and at the end rank 0 merges every rank's file into
RUN_DIR/timeline.json: one row (process) per rank, named with its host, a "step N" span per step on its first
track and the step's phases (data, h2d, compute, comm, optim, ckpt, pipeline) inside it on the second. Times
are wall-clock microseconds (each process's monotonic clock anchored once to time.time()), so the ranks of one
machine line up exactly and those of several as well as their clocks agree. On a GPU the phases are CUDA event
times anchored at the host time the step began (the GPU runs behind the host: the spans are the device's
durations, placed from the step's start).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

DIR, MERGED = "timeline", "timeline.json"


class Timeline:
    """One rank's spans since its last flush: (name, start_s, seconds, track) on the process's monotonic clock."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = run_dir / DIR / f"rank-{rank:05d}.jsonl"
        self.rank = rank
        self.offset = time.time() - time.perf_counter()  # monotonic -> wall clock, once
        self.spans: list[tuple[str, float, float, int]] = []
        self.step = 0  # the last step whose spans were added

    def add_step(self, step: int, spans: list[tuple[str, float, float]]) -> None:
        """Step ``step``'s phases: the ``step`` span on track 0, the others on track 1."""
        self.step = step
        for name, start, seconds in spans:
            self.spans.append((f"step {step}" if name == "step" else name, start, seconds, 0 if name == "step" else 1))

    def add(self, name: str, start: float, seconds: float) -> None:
        """A span outside any step (a checkpoint's stall), on the phases' track."""
        self.spans.append((name, start, seconds, 1))

    def flush(self) -> None:
        if not self.spans:
            return
        if not self.path.exists():  # first line: who wrote it
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"rank": self.rank, "host": socket.gethostname()}) + "\n",
                                 encoding="utf-8")
        events = [[name, round((start + self.offset) * 1e6, 1), round(seconds * 1e6, 1), track]
                  for name, start, seconds, track in self.spans]
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(events) + "\n")
        self.spans = []


def merge(run_dir: Path, world_size: int) -> Path:
    """RUN_DIR/timeline.json from every rank's file (the Chrome trace event format: "X" complete events, pid =
    rank, tid = track; metadata events name the rows)."""
    events: list[dict[str, Any]] = []
    for rank in range(world_size):
        path = run_dir / DIR / f"rank-{rank:05d}.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        host = json.loads(lines[0])["host"] if lines else "?"
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for tid, what in ((0, "steps"), (1, "phases")):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": what}})
        for line in lines[1:]:
            for name, ts, dur, tid in json.loads(line):
                events.append({"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": rank, "tid": tid,
                               "cat": "step" if tid == 0 else "phase"})
    out = run_dir / MERGED
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")
    tmp.replace(out)
    return out
