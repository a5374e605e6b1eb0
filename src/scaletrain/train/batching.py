"""How samples map onto steps: per-rank batch x world x accumulation, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.errors import ConfigError
from scaletrain.train.lr import scaled_lr


@dataclass(frozen=True)
class BatchPlan:
    batch_size: int  # samples per rank per micro-step
    world_size: int
    accum_steps: int
    steps_per_epoch: int
    total_steps: int
    peak_lr: float  # after the linear scaling rule, if enabled

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across all ranks (the effective batch)."""
        return self.batch_size * self.world_size * self.accum_steps

    def describe(self) -> str:
        return (f"effective batch {self.global_batch} = {self.batch_size} per rank x {self.world_size} "
                f"rank{'s' if self.world_size > 1 else ''} x {self.accum_steps} accumulation")


def plan_batches(cfg: Config, world_size: int, train_size: int) -> BatchPlan:
    """Resolve accumulation from train.global_batch (if set), the steps to run and the peak lr."""
    b, train = cfg.data.batch_size, cfg.train
    per_micro = b * world_size
    accum = train.accum_steps
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
        accum = train.global_batch // per_micro
    step_samples = per_micro * accum
    steps_per_epoch = train_size // step_samples
    if steps_per_epoch < 1:
        raise ConfigError("data.batch_size", b,
                          f"a global batch ({b} x {world_size} x {accum} = {step_samples}) no larger than the "
                          f"{train_size} training samples", "a smaller --data.batch_size or fewer ranks")
    total = train.max_steps or train.epochs * steps_per_epoch
    lr = cfg.optim.lr
    if cfg.optim.scale_lr:
        lr = scaled_lr(lr, step_samples, cfg.optim.base_batch)
    return BatchPlan(b, world_size, accum, steps_per_epoch, total, lr)
