"""How samples map onto steps: per-rank batch x world x accumulation, checked once.

A run resumed at another world size keeps the checkpoint's global batch when it can, by changing the
accumulation (2 ranks x 32 -> 1 rank x 32 x 2 accumulation), and says so; when it cannot (the old global batch
is not a multiple of the new batch_size x world), the change is stated, and the linear scaling rule, if on,
follows it. Never silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletrain.config import Config
from scaletrain.errors import ConfigError
from scaletrain.layout import dp_world_size


@dataclass(frozen=True)
class BatchPlan:
    batch_size: int  # samples per rank per micro-step
    world_size: int
    accum_steps: int
    steps_per_epoch: int
    total_steps: int
    peak_lr: float  # after the linear scaling rule, if enabled
    note: str = ""  # what a resume at another world size changed or kept
    readers: str = "rank"  # what world_size counts: "data-parallel rank" when tensor/pipeline ranks share batches

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across all ranks (the effective batch)."""
        return self.batch_size * self.world_size * self.accum_steps

    def describe(self) -> str:
        return (f"effective batch {self.global_batch} = {self.batch_size} per rank x {self.world_size} "
                f"{self.readers}{'s' if self.world_size > 1 else ''} x {self.accum_steps} accumulation")


def _accumulation(cfg: Config, world_size: int, resume: dict[str, Any] | None,
                  ranks: str = "world size") -> tuple[int, str]:
    b, train = cfg.data.batch_size, cfg.train
    per_micro = b * world_size
    if train.global_batch:
        if train.global_batch % per_micro:
            lower = max(per_micro, train.global_batch // per_micro * per_micro)
            raise ConfigError("train.global_batch", train.global_batch,
                              f"a multiple of data.batch_size x world size = {b} x {world_size} = {per_micro}",
                              f"--train.global_batch={lower} or a data.batch_size that divides it")
        if train.accum_steps not in (1, train.global_batch // per_micro):
            raise ConfigError("train.accum_steps", train.accum_steps,
                              f"1 or {train.global_batch // per_micro} (= global_batch / (batch_size x world))",
                              "set only one of train.global_batch and train.accum_steps")
        return train.global_batch // per_micro, ""
    if resume is None or int(resume["world_size"]) == world_size:
        return train.accum_steps, ""
    was_world, was_global = int(resume["world_size"]), int(resume["global_batch"])
    if train.accum_steps == 1 and was_global % per_micro == 0:
        accum = was_global // per_micro
        return accum, (f"{ranks} {was_world} -> {world_size}: accumulation {accum} keeps the global batch "
                       f"at {was_global}")
    now = per_micro * train.accum_steps
    why = "train.accum_steps is set" if train.accum_steps != 1 else \
        f"{was_global} is not a multiple of batch_size x world = {per_micro}"
    keep = _keeping(was_global, b, world_size, accum_set=train.accum_steps != 1)
    return train.accum_steps, (f"{ranks} {was_world} -> {world_size}: the global batch changes {was_global} -> "
                               f"{now} ({why}); {keep}")


def check_global_batch(cfg: Config, world_size: int) -> None:
    """train.global_batch (and accum_steps) against ``world_size`` ranks, for a job laid out before any data is
    read (a Slurm script, a SkyPilot task, a rehearsal): the line the cluster would give, said now."""
    _accumulation(cfg, dp_world_size(cfg.parallel, world_size), None)


def _keeping(global_batch: int, batch_size: int, world_size: int, *, accum_set: bool) -> str:
    """The settings that keep ``global_batch`` on ``world_size`` ranks (a per-rank batch no larger than
    ``batch_size``, so that it still fits in memory), or that none can: it must be a multiple of the world."""
    if global_batch % world_size:
        return (f"no setting keeps {global_batch} on {world_size} ranks ({global_batch} is not a multiple of "
                f"{world_size})")
    per_rank = global_batch // world_size
    fits = max(d for d in range(1, min(batch_size, per_rank) + 1) if per_rank % d == 0)
    flags = [f"--data.batch_size={fits}"] if fits != batch_size else []
    flags += ["no --train.accum_steps"] if accum_set else []
    return f"{' and '.join(flags)} keeps it at {global_batch} (accumulation {per_rank // fits})"


def _total_steps(cfg: Config, steps_per_epoch: int, step_samples: int, train_size: int,
                 resume: dict[str, Any] | None) -> int:
    if cfg.train.max_steps:
        return cfg.train.max_steps
    if resume is None:
        return cfg.train.epochs * steps_per_epoch
    # Steps already done, then the rest of the interrupted epoch at this step size, then whole epochs.
    loader = resume["loader"]
    epoch, cursor = int(loader["epoch"]), int(loader["cursor"])
    if int(loader.get("step_samples", step_samples)) == step_samples:
        end = int(loader.get("end", steps_per_epoch * step_samples))
    else:
        end = cursor + (train_size - cursor) // step_samples * step_samples
    left = (end - cursor) // step_samples
    return int(resume["step"]) + left + max(0, cfg.train.epochs - epoch - 1) * steps_per_epoch


def plan_batches(cfg: Config, world_size: int, train_size: int | None,
                 resume: dict[str, Any] | None = None) -> BatchPlan:
    """Resolve accumulation (from train.global_batch, or from a resumed checkpoint's global batch), the steps
    to run and the peak lr. ``resume``: the checkpoint's world_size, global_batch, step and loader state.
    ``train_size`` None: a stream, whose length is unknown: train.max_steps says how long to train, and
    steps_per_epoch is 0.
    ``world_size``: every rank; the batch arithmetic counts the data-parallel ones (the ranks of a
    tensor-parallel group or a pipeline read one batch together)."""
    every, world_size = world_size, dp_world_size(cfg.parallel, world_size)
    ranks = "world size" if every == world_size else "data-parallel ranks"
    if resume is not None and "layout" in resume:  # the readers it had, not its ranks
        was = resume["layout"]
        readers = int(was["dp_replicate"]) * int(was["dp_shard"])
        if readers != int(resume["world_size"]):
            ranks = "data-parallel ranks"
        resume = {**resume, "world_size": readers}
    b = cfg.data.batch_size
    accum, note = _accumulation(cfg, world_size, resume, ranks)
    step_samples = b * world_size * accum
    if resume is not None and not note and int(resume["global_batch"]) != step_samples:
        note = f"the global batch changes {resume['global_batch']} -> {step_samples} (the configuration changed)"
    if train_size is None:
        if not cfg.train.max_steps:
            raise ConfigError("train.max_steps", 0, "a number of steps for a training stream (an IterableDataset "
                              "has no length, so there are no epochs to count)", "--train.max_steps=1000")
        steps_per_epoch = 0
    else:
        steps_per_epoch = train_size // step_samples
    if train_size is not None and steps_per_epoch < 1:
        raise ConfigError("data.batch_size", b,
                          f"a global batch ({b} x {world_size} x {accum} = {step_samples}) no larger than the "
                          f"{train_size} training samples", "a smaller --data.batch_size or fewer ranks")
    total = _total_steps(cfg, steps_per_epoch, step_samples, train_size, resume)
    lr = cfg.optim.lr
    if cfg.optim.scale_lr:
        from scaletrain.train.lr import scaled_lr  # torch's optimizers: not for a Slurm script's check

        lr = scaled_lr(lr, step_samples, cfg.optim.base_batch)
    readers = "data-parallel rank" if cfg.parallel.tp * cfg.parallel.pp > 1 else "rank"
    return BatchPlan(b, world_size, accum, steps_per_epoch, total, lr, note, readers)
