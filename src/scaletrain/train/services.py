"""The run around the steps (train/session.py's, which scaletrain train and fit() drive too). A run has

- its directory: config.toml (rewritten only when it changed), metrics.jsonl (cut back to the checkpoint's step
  on resume, then appended to);
- the checkpointer (the resumed step counts as saved), and the record of each save in metrics.jsonl;
- per-rank phase totals and the straggler detector, fed once per log interval;
- the preemption agreement at step boundaries (checkpoint.preempt_check=step on several ranks);
- the stop record ("stopped (SIGTERM) at step N: checkpoint ... saved"), and at the end the outputs written even
  on a full disk, with the error that says what stays the latest checkpoint.

What differs between the loops (how a step runs, what is logged, the checkpoint's contents) stays with them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scaletrain.checkpoint import commit
from scaletrain.config import Config, again
from scaletrain.env import RUN_DIR, tell_launcher
from scaletrain.errors import DiskFull, TrainingFailed
from scaletrain.observe.console import Console
from scaletrain.observe.goodput import earlier_attempts
from scaletrain.observe.metrics import MetricsWriter, read_records, write_whole
from scaletrain.observe.stragglers import StragglerDetector, hosts, straggler_line
from scaletrain.observe.timing import PHASES
from scaletrain.runtime import Runtime, after_restart
from scaletrain.train.checkpointing import Checkpointer, Resume, SaveResult
from scaletrain.train.preempt import PreemptFlag, StepAgreement
from scaletrain.train.resume import truncate_metrics
from scaletrain.train.rundir import hold_run_dir

WEIGHTS = "model.safetensors"  # the final weights, in the run directory


class RunServices:
    """What a loop needs around its steps. ``open()`` makes them for a run directory; built directly they have
    no directory (no metrics file, no checkpoints): a loop run for its steps alone, as tests do."""

    def __init__(self, cfg: Config, rt: Runtime, console: Console, writer: MetricsWriter | None = None,
                 checkpointer: Checkpointer | None = None, earlier: dict[str, Any] | None = None) -> None:
        self.cfg, self.rt, self.console = cfg, rt, console
        self.writer = writer or MetricsWriter(None)
        self.checkpointer = checkpointer
        self.hosts = hosts(rt)
        self.stragglers = StragglerDetector(rt.world_size, self.hosts, min_fraction=cfg.log.straggler_min_frac)
        self.phase_totals = [dict.fromkeys(PHASES, 0.0) for _ in range(rt.world_size)]  # seconds, whole run
        self.agreement = StepAgreement(cfg.dist.timeout_s) \
            if cfg.checkpoint.preempt_check == "step" and rt.distributed else None
        self.saves: list[SaveResult] = []
        self.earlier = earlier  # the attempts before this one (observe/goodput.py's earlier_attempts)

    @classmethod
    def open(cls, cfg: Config, rt: Runtime, console: Console, resume: Resume | None, *,
             started: float | None = None) -> RunServices:
        """The run directory's: config.toml, metrics.jsonl (cut back to the resumed step; its records also
        to TensorBoard with log.tensorboard), the checkpointer. Called once the directory is agreed and the
        checkpoint to resume (if any) chosen. ``started``: time.perf_counter() at the run's start (default
        now), for the ``start`` record that begins each attempt's records (observe/goodput.py)."""
        from scaletrain.observe.sinks import TensorBoardSink, check_tensorboard

        run_dir = cfg.run_dir
        writer = MetricsWriter(None)
        if cfg.log.tensorboard:
            check_tensorboard()
        began = time.time() - (time.perf_counter() - started if started is not None else 0.0)
        earlier: list[Any] = [None]
        if rt.is_main:
            restarted = after_restart(rt) is not None
            sinks = [TensorBoardSink(run_dir / "tensorboard")] if cfg.log.tensorboard else []
            run_dir.mkdir(parents=True, exist_ok=True)
            hold_run_dir(run_dir)  # a directory new at start: two runs may both have found it missing
            write_config(run_dir / "config.toml", cfg.to_toml())  # unchanged on resume: nothing written
            # under `scaletrain launch`, after a stop signal it reads this run's records to say whether the
            # workers saved (and exits 0 for a preemption that did), as `scaletrain train` does
            tell_launcher(RUN_DIR, str(run_dir.resolve()))
            if resume is not None:
                metrics = run_dir / "metrics.jsonl"
                earlier[0] = earlier_attempts(read_records(metrics), resume.step, restarted=restarted, started=began)
                truncate_metrics(metrics, resume.step)
            writer = MetricsWriter(run_dir / "metrics.jsonl", append=resume is not None, sinks=sinks)
            writer.write({"kind": "start", "step": resume.step if resume else 0, "process_start": round(began, 3),
                          "restarted": restarted, "world_size": rt.world_size, "earlier": earlier[0]})
        if rt.distributed and resume is not None:  # every rank's summary holds the same account
            dist.broadcast_object_list(earlier, src=0)
        try:
            checkpointer = Checkpointer(cfg.checkpoint, run_dir, rt)
        except BaseException:
            writer.close()
            raise
        if resume is not None:
            checkpointer.last_step = resume.step
        return cls(cfg, rt, console, writer, checkpointer, earlier[0])

    def interval(self, per_rank: list[dict[str, float]], steps: int,
                 late: list[float] | None = None) -> dict[str, Any] | None:
        """One log interval's phase times (seconds per step, per rank) over ``steps`` steps: added to the
        run's totals and, with log.phase_times, given to the straggler detector. Returns its record for
        metrics.jsonl (a newly found straggler is said on the console once), or None. ``late``: each rank's
        lateness per step in its tensor-parallel group's collectives (observe/arrivals.py), or None."""
        for totals, phases in zip(self.phase_totals, per_rank):
            for phase, seconds in phases.items():
                totals[phase] += seconds * steps
        if not self.cfg.log.phase_times:
            return None
        straggler = self.stragglers.update(per_rank, late)
        if straggler is not None and straggler.pop("new"):
            self.console.print(straggler_line(straggler))
        return straggler

    def stop_signal(self, preempt: PreemptFlag) -> int:
        """The signal that stops the run at this step boundary, the same on every rank, 0 if none: this
        process's own on one process, the agreed one with checkpoint.preempt_check=step, else 0 (the log
        step's gather carries the flag)."""
        if not self.rt.distributed:
            return preempt.signum
        if self.agreement is not None:
            return self.agreement.poll(preempt.signum)
        return 0

    def log_saves(self) -> None:
        """The saves that completed since the last call, in metrics.jsonl and (warnings) on the console."""
        if self.checkpointer is not None:
            self.saves += self.checkpointer.report(self.writer, self.console.print)

    def stopped(self, step: int, reason: str) -> dict[str, Any]:
        """The stop record of a run stopped after saving at ``step``: written and said."""
        last = self.saves[-1].path if self.saves else None
        record = {"kind": "stopped", "step": step, "reason": reason, "checkpoint": str(last) if last else None}
        self.writer.write(record)
        self.console.print(f"stopped ({reason}) at step {step}: checkpoint {last} saved; "
                           f"{again(self.cfg.checkpoint.resume)}")
        return record

    def settle(self, preempt: PreemptFlag) -> None:
        """Wait for the save in flight (a stop signal meanwhile waits for it too) and record every save."""
        if self.checkpointer is not None:
            with preempt.saving():
                self.checkpointer.close()
        preempt.finished()
        self.log_saves()

    def disk_full(self, err: DiskFull) -> DiskFull:
        """A full disk outside a save (metrics.jsonl, a final save at a stop): the error, saying what stays
        the latest checkpoint once any save in flight has ended."""
        if err.outcome or self.checkpointer is None:
            return err
        self.checkpointer.close()
        return err.then(self.checkpointer.unchanged())

    def close(self) -> None:
        """Release everything, also after a failure: a save in flight completes first."""
        try:
            if self.agreement is not None:
                self.agreement.close()
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self.writer.close()


def write_outputs(step: int, checkpointer: Checkpointer | None, writes: list[tuple[str, Callable[[], None]]]) -> None:
    """The end of a finished run: every one of ``writes`` (name, write) is tried, in order, even after the disk
    filled up. Then, if the last checkpoint (``checkpointer.failed``) or any of them could not be written, one
    error (DiskFull for a full disk): the first failure, the latest checkpoint, what was written."""
    failed: list[tuple[str, Exception]] = []
    if checkpointer is not None and checkpointer.failed is not None:
        failed.append((f"the checkpoint of step {step}", checkpointer.failed))
    written: list[str] = []
    held: list[str] = []
    for name, write in writes:
        if name == "summary.json" and any(what == WEIGHTS for what, _ in failed) and not _saved_at(step, checkpointer):
            held.append(name)  # the final weights are nowhere: the run is not finished, and must not say so
            continue
        try:
            write()
            written.append(name)
        except DiskFull as err:
            failed.append((name, err))
    if failed:
        raise _unfinished(step, checkpointer, failed, written, held)


def _saved_at(step: int, checkpointer: Checkpointer | None) -> bool:
    """A committed checkpoint of ``step`` is on disk."""
    latest = checkpointer.latest() if checkpointer is not None else None
    return latest is not None and commit.step_of(latest) == step


def _unfinished(step: int, checkpointer: Checkpointer | None, failed: list[tuple[str, Exception]],
                written: list[str], held: list[str]) -> TrainingFailed:
    """What ``write_outputs`` raises: the first failure, then what is on disk instead, and (``held``) the summary
    left out, so that the same command resumes rather than find the run finished."""
    (what, first), others = failed[0], [name for name, _ in failed[1:]]
    latest = checkpointer.latest() if checkpointer is not None else None
    if checkpointer is not None and what.startswith("the checkpoint"):
        notes = [checkpointer.unchanged()]
    elif what == WEIGHTS and _saved_at(step, checkpointer):
        export = f"scaletrain checkpoint export {latest} {getattr(first, 'path', WEIGHTS)}"
        notes = [f"{latest} holds the same weights (`{export}` writes them once there is room)"]
    else:
        notes = [f"{latest} is the latest checkpoint" if latest else "no checkpoint saved"]
    if written:
        notes.append(f"{' and '.join(written)} {'was' if len(written) == 1 else 'were'} written")
    if others:
        notes.append(f"{' and '.join(others)} {'was' if len(others) == 1 else 'were'} not written either")
    if held:
        then = f"resumes from {latest}" if latest else "trains it again (no checkpoint to resume from)"
        notes.append(f"the run is not marked finished ({' and '.join(held)} left out): the same command {then} "
                     "once there is room")
    if isinstance(first, DiskFull):
        return first.then("; ".join(notes))
    return TrainingFailed(f"the checkpoint of step {step} was not saved ({type(first).__name__}: {first}); "
                          + "; ".join(notes))


def save_weights(module: Any, path: Path, *, sharded: bool, is_main: bool, meta: dict[str, str]) -> None:
    """The model's final weights (no wrapper prefix; tied tensors stored once, their other names in the
    metadata's ``aliases`` where the shards were gathered), written whole or not at all by rank 0. Every rank
    calls this: under FSDP the full weights are gathered from the shards first."""
    import safetensors.torch

    from scaletrain.parallel.pipeline import is_stage
    from scaletrain.train.state import full_model_state, stages_state, stored_once

    # The first name of a tied weight is kept (by the module's order, whatever the layout), the others are
    # aliases: safetensors.torch.load_model takes the file as it is, scaletrain's loaders restore the aliases.
    if is_stage(module):  # pipeline stages: every stage's weights, gathered on rank 0 (collective)
        tensors, aliases = stages_state(module)
    else:
        full = full_model_state(module, sharded=sharded)  # collective under FSDP
        tensors, aliases = stored_once(module, full, sharded=sharded) if is_main else ({}, {})
    if not is_main:
        return
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_whole(path, sum(t.nbytes for t in tensors.values()), lambda tmp: safetensors.torch.save_file(
        tensors, str(tmp), metadata={**meta, "aliases": json.dumps(aliases)}))


def write_config(path: Path, text: str) -> None:
    """config.toml, rewritten only when it changed: a resume on a full disk writes nothing before its first
    step."""
    data = text.encode()
    if not (path.is_file() and path.read_bytes() == data):
        write_whole(path, len(data), lambda tmp: tmp.write_bytes(data))
