"""The runs of the batch-size lab: one training run per (global batch, lr rule), planned and checked before
any of them starts, then trained through the trainer users use (in this process, or `scaletrain train --nproc
N` subprocesses), reused where a finished run of the same computation is already there, and never allowed to
stop the others by failing.

A run is named by what it computes: ``b0256-lr0.2-w10`` is global batch 256 at peak lr 0.2 after 10 warmup
steps, so two settings that ask for the same computation (both rules at the smallest batch) share one run.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from scaletrain.config import Config, load
from scaletrain.errors import UserError, first_line

Rule = Literal["linear", "sqrt", "none"]
RULES: tuple[Rule, ...] = ("linear", "sqrt", "none")
# Keys the lab sets for every run, and the lab option that sets each instead.
LAB_KEYS = {"run.dir": "--out", "train.global_batch": "--batches", "train.accum_steps": "--batches",
            "train.max_steps": "--train.epochs (every batch trains the same epochs)",
            "optim.scale_lr": "--scale-lr", "schedule.warmup_steps": "--warmup (in epochs)",
            "schedule.warmup_start": "--warmup (in epochs)",
            "dist.nnodes": "--nproc (the lab runs on this machine)"}
MARK = "lab-run.json"  # in each run directory: the digest of the config the lab trained there


@dataclass(frozen=True)
class Setting:
    """How the lr follows the batch: ``rule`` from the smallest batch's lr, warmed up over ``warmup``."""

    rule: Rule
    warmup: float  # epochs

    @property
    def name(self) -> str:
        if self.rule == "none" and not self.warmup:
            return "no rule"
        return f"{self.rule} + {self.warmup:g} ep warmup"


@dataclass(frozen=True)
class RunSpec:
    batch: int  # global: samples per optimizer step
    setting: Setting
    lr: float  # peak
    warmup_steps: int
    micro: int  # samples per rank per micro-step (accumulation = batch / (micro x nproc))
    steps: int
    dir: Path
    overrides: dict[str, str]  # the command-line options of this run's `scaletrain train`
    digest: str  # of its config (Config.digest): what a run directory must hold to be reused


def peak_lr(rule: Rule, lr0: float, batch: int, batch0: int) -> float:
    """The lr at ``batch`` given ``lr0`` at ``batch0``: x k (Goyal et al.'s linear rule), x sqrt(k), or
    lr0."""
    from scaletrain.train.lr import scaled_lr

    if rule == "linear":
        return scaled_lr(lr0, batch, batch0)
    if rule == "sqrt":
        return lr0 * math.sqrt(batch / batch0)
    return lr0


def check_overrides(overrides: Mapping[str, str]) -> None:
    """Refuse, in one line, a training option the lab sets itself for every run."""
    for key, option in LAB_KEYS.items():
        if key in overrides:
            raise UserError(f"--{key} = {overrides[key]!r}: the batch-size lab sets it for every run; fix: "
                            f"drop it and use {option}")


def _micro(batch: int, nproc: int, per_rank: int) -> int:
    """The largest per-rank micro-batch that divides batch / nproc and is no larger than ``per_rank``
    (data.batch_size: what fits in memory); the rest of the batch is gradient accumulation."""
    if batch % nproc:
        low = batch // nproc * nproc or nproc
        raise UserError(f"--batches: {batch} is not a multiple of --nproc {nproc}: every rank reads the same "
                        f"number of samples; fix: --batches with multiples of {nproc} (e.g. {low})")
    share = batch // nproc
    return max(d for d in range(1, min(share, per_rank) + 1) if share % d == 0)


def _run_name(batch: int, lr: float, warmup_steps: int) -> str:
    return f"b{batch:04d}-lr{lr:.4g}-w{warmup_steps}"


def plan_runs(recipe: str, overrides: Mapping[str, str], batches: Sequence[int], settings: Sequence[Setting],
              out: Path) -> tuple[Config, int, list[RunSpec]]:
    """Every run's settings, checked before any trains: the recipe's config (with the user's overrides), its
    training-set size, and one RunSpec per (setting, batch). The smallest batch trains at the config's own lr
    at that batch (after its linear rule, if on); a larger one's lr follows each setting's rule from there."""
    from scaletrain.data import build_splits

    check_overrides(overrides)
    base = load(recipe, cli_overrides=overrides)
    if base.train.max_steps:  # a config's own (a recipe's, a file's): every batch the same steps would compare
        # different epochs, which is not this lab's question (the command line's is refused above)
        print(f"batch-size lab: note: train.max_steps = {base.train.max_steps} of {recipe} is not used: every "
              f"batch trains {base.train.epochs} epoch(s) (--train.epochs)", file=sys.stderr)
    train_size = len(build_splits(base.data, base.model).train)  # type: ignore[arg-type]
    for batch in batches:
        if batch > train_size:
            raise UserError(f"--batches: {batch} is larger than the {train_size:,} training samples of "
                            f"{recipe}; fix: --batches up to {train_size}")
    batch0 = min(batches)
    lr0 = base.optim.lr
    if base.optim.scale_lr:
        lr0 = peak_lr("linear", lr0, batch0, base.optim.base_batch)
    specs = [_spec(recipe, base, overrides, train_size, setting, batch,
                   peak_lr(setting.rule, lr0, batch, batch0), lr0, out)
             for setting in settings for batch in batches]
    for spec in specs:
        _check_dir(spec)
    return base, train_size, specs


def _spec(recipe: str, base: Config, overrides: Mapping[str, str], train_size: int, setting: Setting,
          batch: int, lr: float, lr0: float, out: Path) -> RunSpec:
    """One run: its micro-batch and accumulation, lr and warmup, its directory, checked by the trainer's own
    batch arithmetic (train/batching.py)."""
    from scaletrain.train.batching import plan_batches

    nproc = base.dist.nproc
    micro = _micro(batch, nproc, base.data.batch_size)
    per_epoch = train_size // batch
    # Goyal et al.'s gradual warmup ramps from lr0 up to lr: none at all where they are the same.
    warmup = round(setting.warmup * per_epoch) if lr != lr0 else 0
    path = out / _run_name(batch, lr, warmup)
    run = {"data.batch_size": micro, "train.global_batch": batch, "train.max_steps": 0, "optim.lr": lr,
           "optim.scale_lr": False,
           "schedule.warmup_steps": warmup, "schedule.warmup_start": lr0 / lr, "train.progress": False,
           "log.every": max(1, per_epoch // 4),  # about 4 points an epoch on the curves, at every batch
           # One eval set for all, whatever their micro-batch (train.eval_batches counts batches).
           "data.eval_batch_size": base.data.eval_batch_size or base.data.batch_size}
    # The lab's settings win (it read data.batch_size and optim.lr above), but for a chosen log.every.
    merged = {**overrides, **{k: str(v) for k, v in run.items()}, "run.dir": str(path)}
    merged.update({k: v for k, v in overrides.items() if k == "log.every"})
    cfg = load(recipe, cli_overrides=merged)
    steps = plan_batches(cfg, nproc, train_size).total_steps
    return RunSpec(batch, setting, lr, warmup, micro, steps, path, merged, cfg.digest())


def _check_dir(spec: RunSpec) -> None:
    """A run directory that already holds something must hold this run (the digest of the same config, written
    by the lab before it trained there), or it is neither reused nor resumed."""
    if not spec.dir.exists():
        return
    if not spec.dir.is_dir():
        raise UserError(f"{spec.dir}: a file where the lab keeps a run directory; fix: another --out, or "
                        "remove the file")
    try:
        was = json.loads((spec.dir / MARK).read_text(encoding="utf-8")).get("digest")
    except (OSError, json.JSONDecodeError, AttributeError):
        was = None
    if was != spec.digest and (was is not None or any(spec.dir.iterdir())):
        said = f"config digest {was}, this run's {spec.digest}" if was else f"no {MARK} of this lab's in it"
        raise UserError(f"{spec.dir} holds a run of another configuration ({said}); fix: another --out, or "
                        f"remove {spec.dir}")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def train(spec: RunSpec, recipe: str, nproc: int) -> dict[str, Any]:
    """Train one run (or reuse its finished summary): ``{"summary": ..., "reused": bool}`` or, where it
    failed, ``{"failed": one line}``. The run's console output goes to train.log in its directory."""
    summary = read_summary(spec.dir)
    if summary is not None:
        return {"summary": summary, "reused": True}
    try:
        spec.dir.mkdir(parents=True, exist_ok=True)
        mark = {"digest": spec.digest, "recipe": recipe, "overrides": spec.overrides}
        (spec.dir / MARK).write_text(json.dumps(mark, indent=2) + "\n", encoding="utf-8")
        failed = _subprocess(spec, recipe, nproc) if nproc > 1 else _in_process(spec, recipe)
    except Exception as err:  # noqa: BLE001 -- any failure of one run is its row, not the end of the lab
        failed = first_line(err)
    summary = read_summary(spec.dir)
    if summary is None:
        return {"failed": failed or "the run left no summary.json"}
    return {"summary": summary, "reused": False}


def _in_process(spec: RunSpec, recipe: str) -> str:
    from scaletrain.train.run import run as run_training

    cfg = load(recipe, cli_overrides=spec.overrides)
    with open(spec.dir / "train.log", "w", encoding="utf-8") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        result = run_training(cfg)
    return f"stopped ({result['stopped']}) at step {result['steps']}" if "stopped" in result else ""


def _subprocess(spec: RunSpec, recipe: str, nproc: int) -> str:
    """`scaletrain train RECIPE --nproc N ...`, launched as the CLI launches it (torchrun's agent)."""
    argv = [sys.executable, "-m", "scaletrain", "train", recipe,
            *(f"--{k}={v}" for k, v in spec.overrides.items())]
    log_path = spec.dir / "train.log"
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code == 0:
        return ""
    if code == 128 + signal.SIGINT:  # Ctrl-C reached the run too: it saved where it could; stop the lab
        raise KeyboardInterrupt
    text = log_path.read_text(encoding="utf-8", errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    return f"exit code {code}: {lines[-1].strip() if lines else 'no output'}"


def curves(run_dir: Path) -> dict[str, list[list[float]]]:
    """The run's training loss and evaluations against epochs: ``{"train": [[epoch, loss], ...],
    "eval_loss": ..., "eval_accuracy": ...}`` from metrics.jsonl (docs/metrics.md), epochs counted as
    step / steps per epoch."""
    summary = read_summary(run_dir) or {}
    per_epoch = summary["steps"] / summary["epochs"] if summary.get("epochs") else 1.0
    found: dict[str, list[list[float]]] = {"train": [], "eval_loss": [], "eval_accuracy": []}
    try:
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        epoch = rec.get("step", 0) / per_epoch
        if rec.get("kind") == "train" and "loss" in rec:
            found["train"].append([epoch, rec["loss"]])
        elif rec.get("kind") == "eval":
            for key in ("eval_loss", "eval_accuracy"):
                if key in rec:
                    found[key].append([epoch, rec[key]])
    return found
