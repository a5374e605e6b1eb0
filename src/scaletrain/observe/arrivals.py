"""Which rank of a tensor-parallel group the others wait for: when each rank issued the group's collectives.

Under tensor parallelism the ranks of a group meet in a collective several times per block, forward and
backward, so every step takes the slowest rank's time and a rank that computes slowly hides inside the others'
waits (observe/timing.py cannot see it: ``pre_comm`` ends where forward starts). Between two collectives every
rank starts together (the previous one released them) and the slow one arrives last at the next: its lateness at
each collective, summed over a step, is how much longer its own work took. torch's Flight Recorder already keeps
the time each collective was issued (``time_created_ns``, the host clock) for every process group, on Gloo and
NCCL (dist.flight_recorder); nothing is added to the step. At a log step each rank reads its record once and
reports the mean issue time of the group's collectives of the interval (up to the last ``WINDOW``) with their
sequence numbers; the gathered readings become each rank's lateness per step (``Arrivals.update``), which the
straggler detector adds to the rank's own time. Reading the record costs (it is all of it, unpickled): it is read at every
log step or every few, so that it takes at most 0.5% of the time, and the last reading stands in between.

The clocks compared are one machine's (tensor parallelism stays within a machine: layout.py). Host issue times
show a slow host (a slow CPU, Python, a data or copy stall inside the step, a CPU contended by another job) and
on CPUs slow compute. On GPUs the host runs ahead of the device, so a rank whose GPU computes slowly is not seen
this way: its host issues the collectives on time and waits later.
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any

WINDOW = 1024  # the last collectives of an interval that are compared (the record keeps dist.flight_recorder)
EPOCH_NS = 1_700_000_000 * 10**9  # subtracted before the mean: float64 then resolves the seconds to ~1e-8
FIELDS = 5  # read(): mean issue time (s), first and last sequence number, collectives since the last read, its cost (s)
COST = 0.005  # the share of the training time reading may take: read every ``every(...)``-th log step


def _entries() -> list[dict[str, Any]]:
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        return list(pickle.loads(_dump_fr_trace(True, False)).get("entries", []))
    except Exception:  # noqa: BLE001 -- a private API, missing in some builds or off (dist.flight_recorder=0)
        return []


class Arrivals:
    """This rank's issue times of its tensor-parallel group's collectives (process group ``group_name``), read
    at the log steps due() says, and every rank's lateness made of the gathered readings (``groups``: the ranks
    of each tensor-parallel group, Layout.groups("tp")). The same decisions on every rank: they are made from
    the gathered rows."""

    def __init__(self, group_name: str, groups: list[list[int]]) -> None:
        self.group, self.groups = group_name, groups
        self._last = 0  # the last sequence number read
        self._every, self._logs, self._steps = 1, 0, 0  # read every n log steps; log steps and steps since a read
        self._late: list[float] | None = None  # the last reading's lateness, standing until the next

    def due(self) -> bool:
        """Whether this log step reads the record (every(...)-th log step)."""
        return self._logs % self._every == 0

    def update(self, rows: list[list[float]], before: list[float], steps: int,
               interval_s: float) -> list[float] | None:
        """Every rank's lateness per step (module ``lateness``) from this log step's gathered ``rows`` where
        they were read (due()), else the last reading's; ``before``: each rank's pre_comm per step, ``steps``:
        steps in this interval of ``interval_s`` seconds. Call once per log step, after the gather."""
        self._steps += steps
        if self.due():
            self._late = lateness(rows, self.groups, self._steps, before)
            self._every, self._steps, self._logs = every(rows, interval_s), 0, 0
        self._logs += 1
        return self._late

    def read(self) -> list[float]:
        """[mean issue time in seconds after EPOCH_NS, first and last sequence number, collectives since the last
        read, the seconds this read took] over the group's collectives since the last read (the last WINDOW of
        them); zeros if none."""
        started = time.perf_counter()
        seqs = sorted((e["collective_seq_id"], e["time_created_ns"]) for e in _entries()
                      if e.get("process_group", ("",))[0] == self.group and not e.get("is_p2p")
                      and e["collective_seq_id"] > self._last)
        if not seqs:
            return [0.0] * FIELDS
        last = seqs[-1][0]
        window = [t for seq, t in seqs if seq > last - WINDOW]
        first = last - len(window) + 1
        since, self._last = last - self._last, last
        return [sum(t - EPOCH_NS for t in window) / len(window) / 1e9, float(first), float(last), float(since),
                time.perf_counter() - started]


def every(rows: list[list[float]], interval_s: float) -> int:
    """Read at every how many log steps so that reading costs at most COST of the time: the record is the whole
    Flight Recorder, unpickled (measured: 19 ms for its 2,000 entries on this project's 2-core VM). The same on
    every rank (computed from the gathered rows)."""
    cost = max((row[4] for row in rows), default=0.0)
    return max(1, math.ceil(cost / (COST * interval_s))) if interval_s > 0 else 1


def lateness(rows: list[list[float]], groups: list[list[int]], steps: int, before: list[float]) -> list[float]:
    """Seconds per step of each rank's own work inside the step that its group's waits hid: how much later than
    the group's earliest rank it arrived, summed over the step's collectives ((its mean issue time - the earliest
    rank's) x the group's collectives per step), less how much later it already was when forward began
    (``before``: each rank's pre_comm per step, which counts a data or copy straggler already). ``rows``: each
    rank's read(); ``groups``: the ranks of each tensor-parallel group. 0 for a group whose ranks did not read the
    same collectives (a record that lost some) or read none."""
    late = [0.0] * len(rows)
    for group in groups:
        got = [rows[r] for r in group]
        if any(g[2] <= 0 or g[1:3] != got[0][1:3] for g in got):
            continue
        first = min(group, key=lambda r: rows[r][0])
        per_step = got[0][3] / max(steps, 1)
        for r in group:
            late[r] = (rows[r][0] - rows[first][0]) * per_step - (before[r] - before[first])
    return late
