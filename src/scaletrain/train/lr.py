"""Learning-rate rules: the linear scaling rule and warmup-then-decay schedules."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from scaletrain.config import ScheduleConfig


def scaled_lr(base_lr: float, global_batch: int, base_batch: int) -> float:
    """Goyal et al. (2017): when the minibatch is multiplied by k, multiply the learning rate by k."""
    return base_lr * global_batch / base_batch


class WarmupDecay:
    """Step -> factor of the peak lr: linear warmup from ``warmup_start``, then cosine, linear, step or
    constant. A plain object, not a closure, so LambdaLR's state_dict can save it."""

    def __init__(self, cfg: ScheduleConfig, total_steps: int) -> None:
        self.total, self.warmup, self.start = total_steps, cfg.warmup_steps, cfg.warmup_start
        self.decay, self.floor, self.gamma = cfg.decay, cfg.min_lr_ratio, cfg.gamma
        self.every = cfg.step_every or max(1, (total_steps - cfg.warmup_steps) // 3)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.start + (1.0 - self.start) * step / self.warmup
        done = step - self.warmup
        progress = min(1.0, done / max(1, self.total - self.warmup))
        if self.decay == "cosine":
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "linear":
            return 1.0 - (1.0 - self.floor) * progress
        if self.decay == "step":
            return self.gamma ** (done // self.every)
        return 1.0


def build_scheduler(optimizer: Optimizer, cfg: ScheduleConfig, total_steps: int) -> LambdaLR:
    """Call ``.step()`` once per optimizer step; step 0 runs at factor(0)."""
    return LambdaLR(optimizer, WarmupDecay(cfg, total_steps))
