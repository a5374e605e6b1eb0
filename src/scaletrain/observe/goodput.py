"""Honest run totals: throughput in steady state, and where the wall time went (goodput).

A run's average throughput counts its first steps, which compile (torch.compile), allocate, autotune and warm the
caches: 11% MFU for a run that sustains 37% (issue 14's H100 measurements). The summary's samples/s, tokens/s and
MFU are therefore those of the steady state: the log intervals after the first one this process ran (and
after its first WARMUP_STEPS steps), named by their steps. The first interval's time beyond the steady pace is the run's warm-up (compile included).

The account of the wall time, each part in seconds and as a fraction of the wall (they sum to it):

    startup     process start (the CLI) or run() (fit()) until the first step: imports, process group, data,
                model, wrapping, loading a checkpoint
    warmup      the intervals before the steady state, beyond its pace: compile, allocation, autotuning
    compute     training steps at the steady pace, data waits taken out
    data_wait   steps waiting for their batch (per-rank phase times, the mean over ranks)
    eval        evaluations
    checkpoint  the loop blocked by saves (the copy to host; the writing is in the background)
    other       the rest: the log steps' gathers, the end of the loop, waiting for the last save

and, when the run resumed from earlier attempts (a restarted worker group, or the same command again after a
stop), two parts more, so that the parts sum to the whole job's busy time:

    earlier_attempts  their training up to the checkpoint this attempt resumed from: work kept
    restarts          the rest of their time (their startup, evals, work after their last checkpoint, which
                      was lost) and, for a restart by torchrun, the time from their last record to this start

A gap between a stopped attempt and the next one started by hand is idle time, not the job's. The earlier
attempts are read, before a resume cuts metrics.jsonl back, from its records: every record has its ``time``
and each attempt begins with a ``start`` record carrying the account of those before it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

WARMUP_STEPS = 3  # a run's summary leaves out at least its first 3 steps (steady_state's warmup_steps)
PARTS = ("startup", "warmup", "compute", "data_wait", "eval", "checkpoint", "other")
EARLIER = ("earlier_attempts", "restarts")  # only when the run resumed from earlier attempts
NAMES = {"startup": "startup", "warmup": "compile + warm-up", "compute": "training", "data_wait": "data waits",
         "eval": "eval", "checkpoint": "checkpoints", "other": "other", "earlier_attempts": "earlier attempts (kept)",
         "restarts": "earlier start-ups, restarts and lost work"}


def steady_state(records: Sequence[Mapping[str, Any]], skip: int = 1, warmup_steps: int = 0) -> dict[str, Any]:
    """Throughput over the log intervals after the first ``skip`` (warm-up), and that begin after the first
    ``warmup_steps`` steps (with a log interval of a step or two, compile and allocation outlast the first
    interval), from train records (step, step_time_s, samples_per_s; ``steps`` where the records have it) in
    order, as metrics.jsonl has them.

    An interval's time is its steps x step_time_s and its samples that time x samples_per_s; samples/s is the
    total over the kept intervals, step time the median of their per-step times. Raises AssertionError when
    no interval is left."""
    kept = []
    previous, done = 0, 0
    for i, r in enumerate(records):
        steps = int(r.get("steps", r["step"] - previous))
        previous, done = r["step"], done + steps
        if i >= skip and steps > 0 and done - steps >= warmup_steps:
            kept.append((steps, steps * r["step_time_s"], steps * r["step_time_s"] * r["samples_per_s"], r["step"]))
    if not kept:
        raise AssertionError(f"no log interval left after skipping {skip} (of {len(records)})")
    seconds = sum(k[1] for k in kept)
    return {"samples_per_s": sum(k[2] for k in kept) / seconds,
            "step_time_s": statistics.median(k[1] / k[0] for k in kept),
            "timed_steps": sum(k[0] for k in kept), "intervals": len(kept), "seconds": seconds,
            "first_step": kept[0][3] - kept[0][0] + 1, "last_step": kept[-1][3]}


def account(wall_s: float, *, startup_s: float, intervals: Sequence[tuple[int, float]], steady_step_s: float | None,
            data_wait_s: float, eval_s: float, checkpoint_s: float,
            earlier: Mapping[str, Any] | None = None, warm_intervals: int = 1) -> dict[str, Any]:
    """The goodput account (module docstring). ``intervals``: (steps, seconds) of each log interval this
    process trained, in order; ``steady_step_s``: the steady-state seconds per step (None: no steady state,
    so no warm-up is told apart); ``earlier``: earlier_attempts()'s account of the attempts before this one;
    ``warm_intervals``: how many leading intervals the steady state left out (their time beyond the steady
    pace is the warm-up)."""
    train_s = sum(seconds for _, seconds in intervals)
    warmup = 0.0
    if steady_step_s is not None:
        warmup = sum(max(0.0, seconds - steps * steady_step_s) for steps, seconds in intervals[:warm_intervals])
    data_wait = min(max(0.0, data_wait_s), train_s - warmup)
    parts = {"startup": startup_s, "warmup": warmup, "compute": train_s - warmup - data_wait,
             "data_wait": data_wait, "eval": eval_s, "checkpoint": checkpoint_s}
    parts["other"] = max(0.0, wall_s - sum(parts.values()))
    if earlier:
        parts["earlier_attempts"] = earlier["kept_train_s"]
        parts["restarts"] = max(0.0, earlier["busy_s"] - earlier["kept_train_s"])
    total = sum(parts.values())  # the wall, unless the measured parts overran it (clock granularity)
    useful = parts["compute"] + parts.get("earlier_attempts", 0.0)
    return {"wall_s": total, "parts_s": parts, "attempts": 1 + (earlier["attempts"] if earlier else 0),
            "fraction": {k: v / total if total > 0 else 0.0 for k, v in parts.items()},
            "goodput": useful / total if total > 0 else 0.0}


def run_totals(records: Sequence[Mapping[str, Any]], *, wall_s: float, startup_s: float,
               phase_totals: Sequence[Mapping[str, float]], eval_s: float, checkpoint_s: float,
               earlier: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, float | None, dict[str, Any]]:
    """A run's summary of its own log intervals (``records``: this process's, each with its ``steps``):
    (the steady-state window -- first_step, last_step, timed_steps, intervals -- or None when no interval
    is left after the warm-up; its samples/s, or None; the goodput account, the data waits being the mean over
    ranks of ``phase_totals``' data seconds)."""
    try:
        steady: dict[str, Any] | None = steady_state(records, warmup_steps=WARMUP_STEPS)
    except AssertionError:  # nothing after the warm-up to tell it from
        steady = None
    # the pace the warm-up is told apart by, and how many leading intervals it spans
    pace: float | None = None
    warm = 0
    if steady is not None:
        pace, warm = steady["seconds"] / steady["timed_steps"], sum(r["step"] < steady["first_step"] for r in records)
    elif len(records) > 1:  # a short run: no steady state, but its first interval (the compile) stands out
        pace, warm = statistics.median(r["step_time_s"] for r in records[1:]), 1
    good = account(wall_s, startup_s=startup_s, intervals=[(r["steps"], r["steps"] * r["step_time_s"]) for r in records],
                   steady_step_s=pace, data_wait_s=sum(t["data"] for t in phase_totals) / len(phase_totals),
                   eval_s=eval_s, checkpoint_s=checkpoint_s, earlier=earlier, warm_intervals=warm)
    if steady is None:
        return None, None, good
    window = {k: steady[k] for k in ("first_step", "last_step", "timed_steps", "intervals")}
    return window, steady["samples_per_s"], good


def earlier_attempts(records: Sequence[Mapping[str, Any]], resume_step: int, *, restarted: bool,
                     started: float) -> dict[str, Any] | None:
    """The account of the attempts before this one, from metrics.jsonl's records as the last attempt left
    them (before a resume cuts them back to ``resume_step``): their busy time and the training they handed
    on. ``restarted``: torchrun restarted the group (the gap since the last record is the job's);
    ``started``: this process's start (epoch seconds). None when the records do not say (an attempt by a
    version that wrote no ``start`` record)."""
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    if not starts:
        return None
    last = records[starts[-1]]
    before = last.get("earlier") or {"busy_s": 0.0, "kept_train_s": 0.0, "attempts": 0}
    times = [r["time"] for r in records[starts[-1]:] if isinstance(r.get("time"), (int, float))]
    if not isinstance(last.get("process_start"), (int, float)) or not times:
        return None
    end = max(times)
    kept, previous = 0.0, int(last.get("step", 0))
    for r in records[starts[-1] + 1:]:
        if r.get("kind") == "train" and previous < r.get("step", 0) <= resume_step:
            kept += (r["step"] - previous) * r["step_time_s"]
            previous = r["step"]
    busy = end - last["process_start"] + (max(0.0, started - end) if restarted else 0.0)
    return {"busy_s": before["busy_s"] + busy, "kept_train_s": before["kept_train_s"] + kept,
            "attempts": before["attempts"] + 1}


def describe(goodput: Mapping[str, Any]) -> str:
    """One line for the summary table: every part with its share."""
    return ", ".join(f"{NAMES[k]} {seconds(goodput['parts_s'][k])} ({100 * goodput['fraction'][k]:.0f}%)"
                     for k in (*PARTS, *EARLIER) if k in goodput["parts_s"])


def seconds(s: float) -> str:
    """A duration for the summary: tenths of a second, hundredths below one (a short run's parts read "0.0 s
    (11%)" otherwise)."""
    return f"{s:.2f} s" if 0 < s < 1 else f"{s:.1f} s"


def process_started() -> float:
    """time.perf_counter() at this process's start (Linux: /proc), or now where that is not known: the CLI's
    start-up then counts from its first call."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # field 22 of stat: the start, in clock ticks since boot; CLOCK_BOOTTIME: now, since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()
    return time.perf_counter() - age if 0 <= age < 86400 else time.perf_counter()
