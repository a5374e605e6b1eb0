"""Bring your own model, data and loss: scaletrain.fit() trains them on 1 process, N workers or M machines.

    python examples/byo_model.py [RUN_DIR]                          # one process
    torchrun --nproc_per_node 2 examples/byo_model.py [RUN_DIR]     # two workers, torchrun itself
    scaletrain launch --nproc 2 examples/byo_model.py [RUN_DIR]     # the same, through scaletrain

The task: 8-dimensional Gaussian points, each labelled by which of 4 fixed random directions it points most
along. Every rank builds the same data set from the same seed; scaletrain gives each rank its own shard.
RUN_DIR receives summary.json, metrics.jsonl and model.safetensors; without it each run takes the next free
runs/byo, runs/byo-2, ... (a finished run is never overwritten).
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import scaletrain


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B, 4) logits
        return self.body(x)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 8) float32 inputs and (n,) int64 labels in [0, 4)."""
    directions = torch.randn(4, 8, generator=torch.Generator().manual_seed(1234))  # the task itself
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x @ directions.T).argmax(dim=1)


def smoothed_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, label_smoothing=0.05)


if __name__ == "__main__":
    # Any --section.key=value on the command line goes on top (--run.dir=..., --parallel.strategy=fsdp); without
    # --run.dir the runs go to runs/byo, runs/byo-2, ...
    scaletrain.fit(Net, make_data(4096, seed=0), eval_data=make_data(1024, seed=1), loss_fn=smoothed_ce,
                   config={"run.name": "byo", "train.epochs": 5, "optim.lr": 3e-3, "log.every": 50},
                   argv=sys.argv[1:])
