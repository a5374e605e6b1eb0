"""The learning-rate schedule as a pure function of the step: linear warmup, then cosine, linear, step or
constant decay, as a factor of the peak lr.

It sits beside config.py, below train/ and observe/, because both use it: the trainer drives its optimizer
with it (train/lr.py wraps it in a LambdaLR) and the report redraws the schedule a run used at every step
from the run's config.toml and summary.json (observe/report/lr.py). One piece of code, so the picture cannot
drift from what the run did.
"""

from __future__ import annotations

import math

from scaletrain.config import ScheduleConfig


class WarmupDecay:
    """Step -> factor of the peak lr: linear warmup from ``warmup_start``, then cosine, linear, step or
    constant. The lr of step ``s`` (0-based: after ``s`` optimizer steps) is ``peak_lr * factor(s)``.
    A plain object, not a closure, so LambdaLR's state_dict can save it."""

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

