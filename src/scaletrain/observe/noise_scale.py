"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A), from gradient norms a data-parallel run already has.

Each rank's gradient before the all-reduce is an estimate of the true gradient G at the small batch B_small (the
rank's samples); the averaged gradient after it is one at the big batch B_big = B_small x ranks. For a gradient
estimated from B samples, E|G_B|^2 = |G|^2 + tr(Sigma) / B, so two batch sizes give unbiased estimates of both:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

(|G_small|^2 the mean of the ranks' squared norms). Each is noisy step to step; their ratio is biased when
taken per step, so the paper smooths numerator and denominator separately (an exponential moving average)
and divides the averages: NoiseScale does that. B_simple is the batch size at which the gradient's noise and
its signal are equal: well below it, doubling the batch nearly halves the steps to a given loss; well above
it, more data-parallel ranks buy little (the critical batch size, to which B_simple is a first estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def unbiased(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimated from the mean squared norm ``small_sq`` of gradients over ``b_small`` samples
    and the squared norm ``big_sq`` of their mean over ``b_big`` samples (the module docstring)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return g2, trace


@dataclass
class NoiseScale:
    """B_simple smoothed over steps: exponential moving averages of |G|^2 and tr(Sigma), divided (the paper's
    estimator). ``decay``: the weight of the past per update (0.9: about the last 10 updates)."""

    decay: float = 0.9
    g2: float = math.nan
    trace: float = math.nan
    updates: int = 0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> None:
        g2, trace = unbiased(small_sq, big_sq, b_small, b_big)
        if self.updates == 0:
            self.g2, self.trace = g2, trace
        else:
            self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
            self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.updates += 1

    @property
    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2 from the averages; NaN before any update or while the averaged |G|^2 is not positive
        (the gradient's signal lost in its noise: too few updates averaged yet)."""
        if self.updates == 0 or not self.g2 > 0:
            return math.nan
        return self.trace / self.g2
