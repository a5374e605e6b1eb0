"""Learning-rate rules: the linear scaling rule, and the warmup-then-decay schedule (scaletrain.schedule,
shared with the report) driving the optimizer."""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from scaletrain.config import ScheduleConfig
from scaletrain.schedule import WarmupDecay


def scaled_lr(base_lr: float, global_batch: int, base_batch: int) -> float:
    """Goyal et al. (2017): when the minibatch is multiplied by k, multiply the learning rate by k."""
    return base_lr * global_batch / base_batch


def build_scheduler(optimizer: Optimizer, cfg: ScheduleConfig, total_steps: int) -> LambdaLR:
    """Call ``.step()`` once per optimizer step; step 0 runs at factor(0)."""
    return LambdaLR(optimizer, WarmupDecay(cfg, total_steps))
