"""Naming the slow rank and the bottleneck, from the per-rank phase times of each log interval.

Under DDP every rank's step takes as long as the slowest one's (the all-reduce makes them wait), so step
time cannot find a straggler. The time from the step's start until the rank handed its last gradient bucket
to the all-reduce (``pre_comm``) can: a slow rank's is longer, the others wait in ``comm`` instead. Under
FSDP every all-gather and reduce-scatter of forward and backward can wait, so ``pre_comm`` ends where the
root's forward starts the first all-gather: a data or copy straggler is named, a compute one is not. Under
tensor parallelism a rank's lateness in its group's collectives (observe/arrivals.py) is added to its own time:
a rank computing slowly (on a CPU, or whose host is slow) is named in phase compute.

A rank is flagged when, over a window of log intervals, it is persistently slower than the others: its
excess over the median of the other ranks is positive in every interval of the window, its median excess
is large against the run's own jitter (a robust z-score: median excess / (1.4826 x the median absolute
deviation of each rank's pre_comm over the window), above ``Z_MIN``), and it matters (at least
``min_fraction`` of the median step time, log.straggler_min_frac, and ``MIN_SECONDS``). The phase blamed is the
one in which the rank exceeds the other ranks' median the most.

Why a quarter of the step by default: two ranks sharing a 2-core machine with Gloo's threads were measured
trading 11-12% of the step back and forth for 50-100 steps at a time (rank 1 slower, then rank 0), steadily
enough to pass the persistence and z tests; that is the machine, not a rank, and a rule that names it teaches
users to ignore the line. NVIDIA's straggler detection (nvidia-resiliency-ext, as NeMo configures it) flags a
relative score under 0.7 by default, a rank taking 1.43x the fastest's time; a quarter of the step still
names smaller excesses than that. Dedicated hardware can set it lower.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from scaletrain.config import LogConfig
from scaletrain.observe.timing import PHASES

Z_MIN = 3.5
MIN_FRACTION = LogConfig.straggler_min_frac  # the config's default, one number
MIN_SECONDS = 0.001
WINDOW = 5  # log intervals
BLAMED = ("data", "h2d", "compute", "optim")  # phases a rank spends on its own (comm is waiting for others)
SHARES = tuple(p for p in PHASES if p not in ("step", "pre_comm"))  # the parts a step's time divides into


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _excess(interval: list[dict[str, float]], rank: int, key: str, peers: list[int]) -> float:
    """How much longer ``rank`` took in ``key`` than the median of its ``peers``, in one interval."""
    return interval[rank][key] - _median([interval[other][key] for other in peers])


@dataclass
class StragglerDetector:
    world_size: int
    hosts: list[str]
    window: int = WINDOW
    min_fraction: float = MIN_FRACTION
    history: deque = field(default_factory=deque)  # per interval: per rank: {phase: seconds per step}
    flagged: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its latest finding
    # rank -> the ranks doing the same work, to compare it with (default: every other rank). A pipeline's
    # stages differ by design; the replicas of one stage do not (train/session.py sets them under pp > 1).
    peers: dict[int, list[int]] = field(default_factory=dict)

    def _peers(self, rank: int) -> list[int]:
        return self.peers.get(rank) or [other for other in range(self.world_size) if other != rank]

    def update(self, per_rank: list[dict[str, float]], late: list[float] | None = None) -> dict[str, Any] | None:
        """Add one interval; return the straggler finding for it (the slowest flagged rank) or None. ``late``:
        each rank's lateness per step in its tensor-parallel group's collectives (observe/arrivals.py): time of
        its own that the group's waits hid, added to its compute (and so to its time before the collective)."""
        if self.world_size < 2:
            return None
        if late is not None:
            per_rank = [{**p, "compute": p["compute"] + x, "pre_comm": p["pre_comm"] + x}
                        for p, x in zip(per_rank, late)]
        self.history.append(per_rank)
        while len(self.history) > self.window:
            self.history.popleft()
        if len(self.history) < self.window:
            return None
        step = _median([r["step"] for interval in self.history for r in interval])
        jitter = _median([abs(interval[r]["pre_comm"] - _median([i[r]["pre_comm"] for i in self.history]))
                          for interval in self.history for r in range(self.world_size)])
        noise = max(1.4826 * jitter, 1e-6)
        findings = []
        for rank in range(self.world_size):
            peers = self._peers(rank)
            excess = [_excess(interval, rank, "pre_comm", peers) for interval in self.history]
            slower = _median(excess)
            z = slower / noise
            if not (min(excess) > 0 and z > Z_MIN and slower >= max(self.min_fraction * step, MIN_SECONDS)):
                continue
            phase = max(BLAMED, key=lambda p: _median([_excess(interval, rank, p, peers) for interval in self.history]))
            # against the others' own time; under tensor parallelism that is their step (their time before
            # forward's first collective is a sliver of it)
            others = _median([interval[o]["step" if late is not None else "pre_comm"]
                              for interval in self.history for o in peers])
            findings.append({"rank": rank, "host": self.hosts[rank] if rank < len(self.hosts) else "?",
                             "phase": phase, "slower_by_s": slower,
                             "slower_by_frac": slower / others if others > 0 else 0.0, "z": z,
                             **({"peers": peers} if self.peers.get(rank) else {}),
                             **({"within": "tp"} if late is not None else {})})
        if not findings:
            return None
        worst = max(findings, key=lambda f: f["slower_by_s"])
        new = worst["rank"] not in self.flagged
        self.flagged[worst["rank"]] = {**worst, "intervals": self.flagged.get(worst["rank"], {}).get("intervals", 0)
                                       + 1}
        return {**worst, "new": new}

    def summary(self) -> list[dict[str, Any]]:
        return [self.flagged[r] for r in sorted(self.flagged)]


def phase_fractions(totals: list[dict[str, float]]) -> dict[str, float]:
    """{phase: median over ranks of the phase's share of that rank's step time} over the whole run."""
    per_rank = [shares(t) for t in totals if t["step"] > 0]
    return {phase: _median([s[phase] for s in per_rank]) for phase in SHARES}


def critical_rank(totals: list[dict[str, float]]) -> int:
    """The rank the others wait for: the longest compute before the collective over the run."""
    return max(range(len(totals)), key=lambda r: totals[r]["pre_comm"]) if totals else 0


def shares(total: dict[str, float]) -> dict[str, float]:
    """{phase: its share of the step time} for one rank's totals."""
    return {p: (total[p] / total["step"] if total["step"] > 0 else 0.0) for p in SHARES}


HOST_LEAD = 0.1  # a GPU with less than this fraction of a step still queued when the host catches up waits for it


def bottleneck(totals: list[dict[str, float]], *, device: str, num_workers: int, bucket_mb: float,
               precision: str = "fp32", compiled: bool = False, gpu_lead: float | None = None,
               pipeline: tuple[int, int, str] | None = None, comm_in_compute: str = "",
               stream: bool = False) -> dict[str, str]:
    """The verdict, its evidence (fractions of step time) and the fix. Judged on the critical rank's phases
    (with a straggler, the others' time is mostly waiting for it, which is not what limits the job).
    ``gpu_lead``: on a GPU, the median over log intervals of the work still queued on the GPU when the host
    reached the log step, as a fraction of a step (StepTimer.lead_s); None where not measured. ``pipeline``:
    (pp, micro-batches, schedule) of a pipelined run, whose comm is mostly its bubble. ``comm_in_compute``: the
    collectives that wait inside forward and backward, where the timer counts them as compute (FSDP's, tensor
    parallelism's: observe/timing.py), named so that the evidence does not read "comm 0%". ``stream``: the
    training data is a stream, read in the training process (loader workers do not apply)."""
    world_size = len(totals)
    rank = critical_rank(totals)
    fractions = shares(totals[rank]) if totals else {}
    evidence = " | ".join(f"{p} {100 * fractions.get(p, 0.0):.0f}%" for p in ("data", "h2d", "compute", "comm", "optim",
                                                                            "ckpt"))
    if comm_in_compute:
        evidence = evidence.replace("comm 0%", f"comm in compute ({comm_in_compute})")
    evidence += " of step time" + (f" on rank {rank}, the one the others wait for" if world_size > 1 else "")
    data, comm = fractions.get("data", 0.0), fractions.get("comm", 0.0)
    host = fractions.get("h2d", 0.0) + fractions.get("optim", 0.0)
    if data >= 0.25 and data >= comm:
        if stream:
            fix = ("a faster stream: it is read and collated in the training process (loader workers cannot split "
                   "a stream), so preprocess or tokenize it once ahead of training, or give a map-style dataset, "
                   "which --data.num_workers reads in parallel")
        else:
            fix = (f"more loader workers (--data.num_workers={max(2, 2 * num_workers)})"
                   + (", pin_memory is on" if device == "cuda" else "")
                   + ", data on faster local storage, or preprocessing done once ahead of training")
        return {"verdict": "input-bound", "evidence": evidence, "fix": fix}
    if comm >= 0.25 and pipeline is not None:
        pp, m, schedule = pipeline
        fix = (f"a smaller pipeline bubble (most of a stage's waiting): more micro-batches per step "
               f"(--parallel.microbatches={2 * m}, with a per-rank batch that splits into them)"
               + ("" if schedule == "interleaved" else ", --parallel.pp_schedule=interleaved")
               + f", or fewer stages (--parallel.pp={max(1, pp // 2)}) where the model fits; then stages of equal "
               "work (the last also runs the output layer and the loss)")
        return {"verdict": "communication-bound", "evidence": evidence, "fix": fix}
    if comm >= 0.25:
        fix = ("a larger per-rank batch (--data.batch_size) or gradient accumulation (--train.accum_steps), so "
               f"each all-reduce carries more samples; a bucket size that overlaps better than {bucket_mb:g} MB "
               "(--parallel.bucket_mb); on GPUs NCCL over NVLink/InfiniBand rather than TCP")
        return {"verdict": "communication-bound", "evidence": evidence, "fix": fix}
    if device == "cuda" and gpu_lead is not None and gpu_lead < HOST_LEAD:
        evidence += (f"; at log steps the GPU had only {100 * gpu_lead:.1f}% of a step still queued when the host "
                     "caught up: it waits for Python, and its idle gaps are counted in compute")
        fuse = "" if compiled else "torch.compile (--train.compile=true) to fuse kernels and cut launches; "
        fix = ("more work per kernel: a larger per-rank batch (--data.batch_size) or a larger model per GPU; "
               f"{fuse}no host syncs (.item(), printing tensors) inside the step")
        return {"verdict": "host-bound", "evidence": evidence, "fix": fix}
    if host >= 0.25:
        launches = "" if compiled else ", torch.compile (--train.compile=true) to cut launch overhead,"
        fix = (f"a larger batch per step (fewer optimizer steps and copies per sample){launches} and a fused "
               "optimizer (used where possible)")
        return {"verdict": "host-bound", "evidence": evidence, "fix": fix}
    levers = [] if precision != "fp32" else ["bf16 mixed precision (--train.precision=bf16-mixed)"]
    levers += [] if compiled else ["torch.compile (--train.compile=true)"]
    if levers:
        fix = f"the device is busy computing, so make its work cheaper with {' and '.join(levers)}, or add devices " \
              "(data parallelism scales it)"
    else:
        fix = "the device is busy computing, with bf16 and torch.compile on already: add devices (data parallelism " \
              "scales it)"
    if comm_in_compute:
        fix += (f"; compute includes {comm_in_compute}, which this timing cannot separate: a larger per-rank batch "
                "(--data.batch_size) spreads them over more samples, and where the model fits one device "
                "--parallel.strategy=ddp overlaps one all-reduce per bucket instead (and times it)")
    return {"verdict": "compute-bound", "evidence": evidence, "fix": fix}


def hosts(rt: Any) -> list[str]:
    """Every rank's host name, gathered once (stragglers are named with their host)."""
    import socket

    import torch.distributed as dist

    mine = socket.gethostname()
    if not rt.distributed:
        return [mine]
    found: list[Any] = [None] * rt.world_size
    dist.all_gather_object(found, mine)
    return [str(h) for h in found]


def straggler_line(found: dict[str, Any]) -> str:
    """The console's line for a newly named straggler (StragglerDetector.update's record)."""
    than = (f"ranks {', '.join(map(str, found['peers']))} (its pipeline stage's replicas) in its own work"
            if found.get("peers") else "the other ranks in its own work (its lateness in its tensor-parallel "
            "group's collectives counted)" if found.get("within") == "tp" else "the other ranks before the all-reduce")
    return (f"straggler: rank {found['rank']} (host {found['host']}) is {1000 * found['slower_by_s']:.1f} ms per "
            f"step ({100 * found['slower_by_frac']:.0f}%) slower than {than}, in phase {found['phase']}; the others "
            "wait for it")
