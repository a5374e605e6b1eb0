"""`scaletrain train RECIPE|FILE.toml [--section.key=value ...] [--nproc N]`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from scaletrain.checkpoint import commit
from scaletrain.cli.options import add_config_argument, add_config_options, check_types, config_overrides
from scaletrain.config import Config, again, load

HELP = "Train a built-in recipe or a TOML config, on this process, N local workers, or a torchrun job."


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP + " Precedence: defaults < TOML < command line.",
                       usage="scaletrain train RECIPE|FILE.toml [--section.key=value ...] [--nproc N]",
                       allow_abbrev=False)
    add_config_argument(p)
    add_config_options(p)


def preflight(cfg: Config, world: int) -> None:
    """Everything that can be checked before workers start, so a mistake is one line, not N crashed ranks."""
    from scaletrain.data import build_splits
    from scaletrain.layout import check_layout
    from scaletrain.observe.sinks import check_tensorboard
    from scaletrain.runtime import pick_device
    from scaletrain.train.batching import plan_batches
    from scaletrain.train.precision import check_precision

    check_precision(cfg.train.precision, pick_device(cfg.dist, 0), cfg.parallel.strategy)
    check_layout(cfg.parallel, cfg.memory, world, max(1, cfg.dist.nnodes), cfg.model, cfg.data.batch_size,
                 cfg.data.seq_len)
    cfg.chaos.check_world(world)
    if cfg.log.grad_noise_scale:
        from scaletrain.observe.noise_scale import check_measurable

        check_measurable(tp=cfg.parallel.tp, pp=cfg.parallel.pp, precision=cfg.train.precision)
    if cfg.log.tensorboard:
        check_tensorboard()
    splits = build_splits(cfg.data, cfg.model)
    plan_batches(cfg, world, len(splits.train))  # type: ignore[arg-type]


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.env import adopt_slurm_task, launcher_overrides, under_launcher

    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    cfg = load(args.config, cli_overrides=overrides)
    if cfg.dist.nproc == 1:  # a task of `srun` (one per GPU) is a worker as torchrun's would be
        adopt_slurm_task()
    if under_launcher() and (said := launcher_overrides(cfg.dist.nproc)):
        print(said, file=sys.stderr)  # under torchrun the launcher decides the world
    if under_launcher() or (cfg.dist.nproc == 1 and cfg.dist.nnodes == 1):
        from scaletrain.observe.goodput import process_started
        from scaletrain.train.preempt import Interrupted
        from scaletrain.train.run import run as run_training

        try:
            run_training(cfg, started=process_started())  # the wall time counts imports and start-up too
        except Interrupted:  # Ctrl-C, after saving (and saying so)
            # A worker exits 0: its agent must not take a stop for a failure and restart the group.
            return 0 if under_launcher() else 128 + signal.SIGINT
        return 0
    from scaletrain.cluster.forked import serial_launcher
    from scaletrain.cluster.torchrun import launch  # torch: imported once the config is known to be good
    from scaletrain.train.rundir import choose_run_dir

    serial_launcher()  # so that the workers can be forks of this process
    preflight(cfg, cfg.dist.nproc * cfg.dist.nnodes)
    # Chosen once here so all workers write where this process said; the last --run.dir wins in their argv.
    run_dir = choose_run_dir(cfg).run_dir
    worker_argv = [*argv[argv.index("train"):], f"--run.dir={run_dir}"]
    started = time.time()
    return launch(cfg.dist, ["scaletrain", *worker_argv], module=True, run_id=f"scaletrain-{cfg.run.name}",
                  trainer=True, after_stop=lambda signum: after_signal(signum, run_dir, started, cfg.checkpoint.resume))


def after_signal(signum: int, run_dir: Path, started: float, resume: str = "auto") -> int:
    """This launcher was signalled, and its agent stopped the workers: say in one line whether they saved.
    Ctrl-C exits 130 (128 + SIGINT) as shells expect, so that a script or `make` stops too; a preemption
    (SIGTERM) that saved exits 0, which is what lets a scheduler requeue the job."""
    name = signal.Signals(signum).name
    stop = _stopped_record(run_dir, started)
    if stop and stop.get("checkpoint"):  # the workers saved before stopping: the work is safe
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"preempted ({stop['reason']})"
        print(f"scaletrain: {what} at step {stop['step']}; checkpoint {stop['checkpoint']} saved; {again(resume)}",
              file=sys.stderr)
        return 128 + signum if signum == signal.SIGINT else 0
    if _finished(run_dir, started):
        print(f"scaletrain: {name} came after the run had finished; nothing was lost", file=sys.stderr)
        return 0
    saved = commit.committed(run_dir / "checkpoints")
    kept = (f"the last checkpoint, {saved[-1][1]}, is intact: {again(resume, ' from it')}"
            if saved else f"there is no checkpoint in {run_dir / 'checkpoints'} to resume from")
    print(f"scaletrain: stopped by {name} before the workers could save (they were stopped too); {kept}",
          file=sys.stderr)
    return 128 + signum


def _written_since(path: Path, started: float) -> bool:
    try:
        return path.stat().st_mtime >= started
    except OSError:
        return False


def _finished(run_dir: Path, started: float) -> bool:
    return _written_since(run_dir / "summary.json", started)


def _stopped_record(run_dir: Path, started: float) -> dict[str, Any] | None:
    """This launch's last metrics record if it says the workers stopped after saving a checkpoint."""
    path = run_dir / "metrics.jsonl"
    if not _written_since(path, started):  # a record from an earlier launch says nothing about this one
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8").strip().splitlines()[-1])
    except (OSError, IndexError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("kind") == "stopped" else None
