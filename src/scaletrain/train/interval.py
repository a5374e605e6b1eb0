"""The log interval's sync point (train/session.py's, which fit() and scaletrain train run on).

Between log steps every rank sums what it logs on the device (nothing waits for it). At a log step (a
checkpoint step is one) one all_gather brings every rank's row to every rank and one host-device sync
reads it: the logged sums, the non-finite guard's counters (train/guard.py), a fingerprint of the logged names
(a session's ranks must log the same ones), the preemption signal the rank received, its memory peak, the
samples and tokens it drew, and its phase times. float64 throughout: byte counts and step numbers stay exact.
What the session decides from the rows (the means, a non-finite step, a stop) is its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scaletrain.observe.arrivals import FIELDS as ARRIVAL_FIELDS
from scaletrain.observe.timing import PHASES
from scaletrain.runtime import Runtime
from scaletrain.train.guard import NonFiniteGuard

HOST = 5  # fingerprint, signal, peak, samples, tokens: then the phase times, the GPU lead and the arrivals


@dataclass
class RankReport:
    """One rank's numbers at a sync point, as gather() brings them to every rank."""

    sums: dict[str, float]  # the logged sums since the last log step, by name
    skipped: float  # non-finite steps skipped so far (train/guard.py)
    first_skipped: float  # the first skipped step, -1 if none
    first_bad_loss: float  # the first step whose loss was non-finite on this rank, -1 if none
    names: int  # a fingerprint of the logged names
    signal: int  # the preemption signal received, 0 if none
    peak_bytes: int
    samples: float  # samples drawn since the last log step (a session's loaders; 0 where the loop counts them)
    tokens: float  # of which tokens, where the samples are token ids
    phases: dict[str, float]  # seconds per step over the interval (zeros where not collected)
    lead_s: float  # StepTimer.lead_s (GPU)
    arrivals: list[float]  # observe/arrivals.py Arrivals.read() of its tensor-parallel group (zeros if none)

    @classmethod
    def parse(cls, names: list[str], row: list[float]) -> RankReport:
        n = len(names)
        skipped, first_skipped, first_bad, fingerprint, signal, peak, samples, tokens = row[n:n + 3 + HOST]
        times = row[n + 3 + HOST:]
        return cls(dict(zip(names, row[:n])), skipped, first_skipped, first_bad, int(fingerprint), int(signal),
                   int(peak), samples, tokens, dict(zip(PHASES, times)), times[len(PHASES)],
                   times[len(PHASES) + 1:])


def fingerprint(names: list[str]) -> int:
    """The same small integer on every rank that logs the same names (exact in float64)."""
    return int(hashlib.sha256(",".join(names).encode()).hexdigest()[:12], 16)


def gather(rt: Runtime, sums: dict[str, torch.Tensor], guard: NonFiniteGuard, *, signal: int, peak: int,
           times: list[float], lead: float, samples: float = 0.0, tokens: float = 0.0,
           arrivals: list[float] | None = None) -> list[RankReport]:
    """Every rank's RankReport, on every rank: one all_gather and one host-device sync (none of either on one
    process but the read). ``sums``: this rank's device tensors (0-d), ``times``: its phase times (PHASES),
    ``arrivals``: its Arrivals.read() (observe/arrivals.py; zeros when not given)."""
    names = sorted(sums)
    device_part = torch.stack([*(sums[name] for name in names), *guard.state()]).double()
    host = torch.tensor([float(fingerprint(names)), float(signal), float(peak), float(samples), float(tokens),
                         *times, lead, *(arrivals or [0.0] * ARRIVAL_FIELDS)], dtype=torch.float64)
    mine = torch.cat([device_part.reshape(-1), host.to(device_part.device)])
    if not rt.distributed:
        return [RankReport.parse(names, mine.tolist())]
    rows = [torch.empty_like(mine) for _ in range(rt.world_size)]
    dist.all_gather(rows, mine)
    return [RankReport.parse(names, row) for row in torch.stack(rows).tolist()]  # host-device sync


__all__ = ["RankReport", "fingerprint", "gather"]
