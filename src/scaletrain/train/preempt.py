"""Stopping with a checkpoint, and saying why a restarted job restarted.

Preemption: SIGTERM (a scheduler's or torchrun's stop) or SIGUSR1 (Slurm's --signal=USR1@SECONDS) sets a
flag; the loop reads it at its next sync point, where every rank learns whether any rank was signalled,
and then all of them save a checkpoint together and exit 0. The handler itself does nothing else: a signal
can arrive in the middle of a collective, where saving is impossible.

Ctrl-C (SIGINT) sets the same flag, so the ranks save at the same step; the run then raises Interrupted, a
KeyboardInterrupt, as Ctrl-C does, only later and with the work saved. A second SIGINT (or a SIGINT while a
preemption is already being saved) exits at once with 130 and no checkpoint: the commit protocol keeps the
last committed one whole. Only a SIGINT counts as that second Ctrl-C: the SIGTERM of a launcher that stops
its workers does not.

Catching SIGTERM changes what it means to a process that cannot reach a sync point: one that hangs, or
waits in a collective for a peer that died. torchrun stops the survivors of a failed worker with SIGTERM
and waits 30 s before SIGKILL. So a signal also starts a watchdog: if the loop completes no step for a while
(5 x its recent step time, at least 2 s) and is not saving, the process exits with 128 + the signal, as if
it had not caught it.

After torchrun restarted the group, restart_line() is the one line rank 0 prints about the failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from types import FrameType
from typing import Any

import torch

from scaletrain import runtime
from scaletrain.env import held_signal, under_launcher
from scaletrain.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
MIN_GRACE_S = 2.0
# Slurm's USR1 before the run's first step: its start-up (a resume's load, the first step's compile) is no step
# time to judge by, and the job needs the first step's save and exit 0 for its requeue, so it waits this long
# (Slurm's SIGTERM comes at the end of --signal=USR1@S: 120 s by `scaletrain slurm`). A SIGTERM or Ctrl-C then
# keeps the 2 s: a launcher stopping the survivors of a worker that failed while starting (torchrun would wait
# 30 s for them before its SIGKILL), a user who wants out.
FIRST_STEP_GRACE_S = 120.0


class Interrupted(Stopped):
    """Ctrl-C stopped the run after its checkpoint was saved: raised at the step where the ranks agreed to
    stop rather than wherever the signal arrived. ``record`` is the metrics.jsonl "stopped" record."""

    def __init__(self, record: dict[str, Any]) -> None:
        saved = f"checkpoint {record['checkpoint']}" if record.get("checkpoint") else "a checkpoint"
        super().__init__(f"Ctrl-C: stopped at step {record['step']} after saving {saved}")
        self.record = record


class Preempted(Stopped):
    """SIGTERM or SIGUSR1 stopped a session's loop after its checkpoint was saved (a scheduler's preemption,
    Slurm's warning before the time limit): the program ends with exit code 0, and the next launch resumes."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(f"{record['reason']}: stopped at step {record['step']} after saving a checkpoint")
        self.record = record

    @property
    def exit_code(self) -> int:
        return 0


def say(line: str) -> None:
    """One line on stderr from a signal handler: a raw write, which cannot re-enter a buffered stream that the
    interrupted code was in the middle of writing."""
    os.write(2, (line + "\n").encode())


class PreemptFlag:
    def __init__(self, label: str = "") -> None:
        self.signum = 0  # the first signal received, 0 = none
        self.label = label  # e.g. "[rank 1] ", for the watchdog's one line
        self._previous: dict[int, Any] = {}
        self._last_tick = time.monotonic()
        self._ticked = False
        self._gaps: list[float] = []  # seconds between the recent ticks
        self._saving = 0
        self._finished = False
        self._watchdog: threading.Thread | None = None
        self._owner = os.getpid()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:  # a forked data loader worker: the process it serves decides for it
            return
        if signum == signal.SIGINT and self.signum:
            # after a stop already asked for: a second Ctrl-C, or the first after the launcher's SIGTERM (its
            # agent stopping the workers when one of them died)
            again = "Ctrl-C again" if self.signum == signal.SIGINT else \
                f"Ctrl-C after {signal.Signals(self.signum).name}"
            say(f"{self.label}scaletrain: {again}: stopping now, without a checkpoint (the last committed one stays "
                "whole)")
            os._exit(128 + signum)
        # Set before saying anything: a second Ctrl-C can interrupt this handler once the line is out.
        self.signum = self.signum or signum
        if signum == signal.SIGINT and not under_launcher():  # a launcher says it for all its workers
            say("scaletrain: Ctrl-C: saving a checkpoint after this step, then stopping (Ctrl-C again: stop "
                "now, without one)")
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="scaletrain-preempt-watchdog", daemon=True)
            self._watchdog.start()

    def install(self) -> PreemptFlag:
        """Catch the signals (main thread only: Python delivers signals there). Returns self."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if signum := held_signal():  # it came while the process was starting (env.py hold_stop_signal)
                self._handle(signum, None)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def tick(self) -> None:
        """The loop completed a step (cheap: a clock read and a short list)."""
        now = time.monotonic()
        if self._ticked:
            self._gaps.append(now - self._last_tick)
            del self._gaps[:-16]
        self._ticked = True
        self._last_tick = now

    def _step_time(self) -> float:
        """The median of the recent gaps between steps (evaluations and saves in between do not skew it)."""
        gaps = sorted(self._gaps)
        return gaps[len(gaps) // 2] if gaps else 0.0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint is being written: no step completes, and that is progress."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
            self._last_tick = time.monotonic()

    def finished(self) -> None:
        """The loop is over (the final save is done): the watchdog has nothing left to guard."""
        self._finished = True

    def _watch(self) -> None:
        signalled = time.monotonic()
        while not self._finished:
            time.sleep(0.2)
            grace = FIRST_STEP_GRACE_S if not self._ticked and self.signum == signal.SIGUSR1 else \
                max(MIN_GRACE_S, 5 * self._step_time())
            idle = time.monotonic() - max(self._last_tick, signalled)
            if not self._saving and not self._finished and idle > grace:
                print(f"{self.label}scaletrain: no step completed for {idle:.1f} s after {self.name(self.signum)}: "
                      "exiting without a checkpoint (the process is stuck, or its peers are gone)",
                      file=sys.stderr, flush=True)
                os._exit(128 + self.signum)

    @staticmethod
    def name(signum: int) -> str:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"


class StepAgreement:
    """checkpoint.preempt_check=step: the ranks agree at every step boundary whether any was signalled,
    without waiting for anyone. Each boundary waits for the all-reduce (MAX of the signal) started at the
    previous one, which had a whole step to finish, and starts the next, on a Gloo group of its own so it
    never interleaves with the loop's collectives. Every rank reads the same result at the same boundary."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._flag = torch.zeros(1, dtype=torch.int64)  # a CPU tensor: reading it is no device sync
        self._work: Any = None

    def poll(self, signum: int) -> int:
        """The signal some rank had at the previous boundary (0 = none); ``signum`` is this rank's now."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            agreed = int(self._flag.item())
            if agreed:
                return agreed
        self._flag.fill_(signum)
        self._work = self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self._group,
                                           async_op=True)
        return 0

    def close(self) -> None:
        """Wait for the all-reduce in flight (every rank started it: it completes)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def restart_line(rt: runtime.Runtime, resumed_step: int | None) -> str | None:
    """Rank 0's one line after torchrun restarted the group: which worker failed, how, at which step, and
    where the job goes on from, e.g. ``worker rank 1 (pid 4242) died by SIGKILL at step 13; restarting from
    checkpoint step 8 (restart 1 of 3)``. Says less when less is known (under plain torchrun nobody passes on
    the pid and exit code). None on other ranks and on the job's first group (runtime.after_restart)."""
    if not rt.is_main or (failure := runtime.after_restart(rt)) is None:
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    at = f" at step {failure['step']}" if "step" in failure else ""
    if "rank" in failure:
        who = f"worker rank {failure['rank']} (pid {failure['pid']}) {_exit_words(failure['exitcode'])}{at}"
    elif "missing" in failure:
        who = f"worker rank {failure['missing']} stopped answering{at}"
    else:
        who = f"a worker failed{at}"
    start = "step 0 (no checkpoint to resume)" if resumed_step is None else f"checkpoint step {resumed_step}"
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    count = f"restart {attempt} of {most}" if attempt else "restarted by another machine's launcher"
    return f"{who}; restarting from {start} ({count})"


def _exit_words(exitcode: int) -> str:
    """-9 -> "died by SIGKILL" (a negative exit code is the signal that ended the process); 1 -> "exited with
    code 1"."""
    return f"died by {PreemptFlag.name(-exitcode)}" if exitcode < 0 else f"exited with code {exitcode}"
