"""Small classifiers for images and feature vectors (the digits recipe)."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten -> Linear -> ReLU -> Dropout -> Linear."""

    fsdp_policy_casts = True  # under FSDP its mixed-precision policy alone casts (precision.policy_casts)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                                 nn.Dropout(dropout), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool, a dense head. No batch norm: its statistics would differ per
    rank under data parallelism and break the equivalence with one process."""

    fsdp_policy_casts = True  # under FSDP its mixed-precision policy alone casts (precision.policy_casts)

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, channels: int, hidden: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 2 * channels * (h // 2) * (w // 2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, classes)
        return self.head(self.features(x))
