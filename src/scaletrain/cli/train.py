"""`scaletrain train RECIPE|FILE.toml [--section.key=value ...] [--nproc N]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from scaletrain.cli.options import add_config_argument, add_config_options, check_types, config_overrides
from scaletrain.config import Config, load

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
    from scaletrain.observe.sinks import check_tensorboard
    from scaletrain.parallel import check_layout
    from scaletrain.runtime import pick_device
    from scaletrain.train.batching import plan_batches
    from scaletrain.train.precision import check_precision

    check_precision(cfg.train.precision, pick_device(cfg.dist, 0), cfg.parallel.strategy)
    check_layout(cfg.parallel, cfg.memory, world, max(1, cfg.dist.nnodes))
    if cfg.log.tensorboard:
        check_tensorboard()
    splits = build_splits(cfg.data, cfg.model)
    plan_batches(cfg, world, len(splits.train))  # type: ignore[arg-type]


def _warn_if_launcher_overrides(cfg: Config) -> None:
    """Under torchrun the launcher decides the world; a different --nproc is ignored, and said so."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.dist.nproc not in (1, local) and os.environ.get("RANK") == "0":
        print(f"scaletrain: warning: --nproc {cfg.dist.nproc} ignored: this process runs under a launcher that "
              f"started {local} per machine (world size {os.environ.get('WORLD_SIZE')})", file=sys.stderr)


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.cluster.torchrun import launch
    from scaletrain.runtime import under_launcher
    from scaletrain.train.rundir import choose_run_dir

    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    cfg = load(args.config, cli_overrides=overrides)
    if under_launcher():
        _warn_if_launcher_overrides(cfg)
    if under_launcher() or (cfg.dist.nproc == 1 and cfg.dist.nnodes == 1):
        from scaletrain.train.run import run as run_training

        run_training(cfg)
        return 0
    preflight(cfg, cfg.dist.nproc * cfg.dist.nnodes)
    # Chosen once here so all workers write where this process said; the last --run.dir wins in their argv.
    run_dir = choose_run_dir(cfg).run_dir
    worker_argv = [*argv[argv.index("train"):], f"--run.dir={run_dir}"]
    code = launch(cfg.dist, ["scaletrain", *worker_argv], module=True, run_id=f"scaletrain-{cfg.run.name}",
                  report_signal=False)
    if code <= 128:
        return code
    stop = _stopped_record(run_dir)
    if stop and stop.get("checkpoint"):
        # The launcher was signalled too, but the workers saved before stopping: the work is safe.
        print(f"scaletrain: preempted ({stop['reason']}) at step {stop['step']}; checkpoint {stop['checkpoint']} "
              "saved; run the same command again to resume", file=sys.stderr)
        return 0
    print(f"scaletrain: stopped by signal {code - 128} before the workers could save; the workers were stopped "
          "too", file=sys.stderr)
    return code


def _stopped_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's last metrics record if it says the workers stopped after saving a checkpoint."""
    try:
        last = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").strip().splitlines()[-1]
        record = json.loads(last)
    except (OSError, IndexError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("kind") == "stopped" else None
