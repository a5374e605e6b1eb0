"""Data and a model whose held-out measures peak within a few epochs and then worsen: half the training labels
are noise, which a wide net overfits. Early stop, the best checkpoint and a monitored metric need a best
before the end (tests/cli/test_early_stop.py, test_best_checkpoint.py, test_fit_metrics.py)."""

from __future__ import annotations

import torch
from torch import nn


def noisy_labels(n: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of 8 features, the class the sign of the first; the first 300 labels drawn at random."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long()
    y[:300] = torch.randint(0, 2, (300,), generator=g)
    return x, y


def wide_net() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 2))
