"""A layer run more than once a step inside torch.utils.checkpoint(use_reentrant=True): one line, not wrong steps.

Weight sharing (ALBERT's one layer run as every layer, a Universal Transformer) with the user's own reentrant
checkpointing: under DDP torch stopped the first backward with a page of "Expected to mark a variable ready only
once"; under FSDP2 the layer's later reentrant backwards left it unsharded with plain, partial gradients, and
training went on with wrong steps (eval loss 0.7892 where one process says 0.7512, 2 ranks, 12 steps), without a
word. Both are one line naming use_reentrant=False now; checkpointing without reentrance trains under both alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn_ranks import run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint


class Looped(nn.Module):
    """One block run three times, each run checkpointed by the model itself."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.out, self.reentrant = nn.Linear(8, 16), nn.Linear(16, 4), reentrant
        block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.blocks = nn.ModuleList([block] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h)


def _fits(rank: int, world: int, where: str) -> dict[str, object]:
    import scaletrain
    from scaletrain.errors import UserError

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :2].sum(1) > 0).long() + 2 * (x[:, 2] > 0).long()
    said: dict[str, object] = {}
    for strategy in ("ddp", "fsdp"):
        for reentrant in (True, False):
            torch.manual_seed(0)
            key = f"{strategy}-{'reentrant' if reentrant else 'plain'}"
            try:
                summary = scaletrain.fit(Looped(reentrant), (x, y), config={
                    "run.dir": str(Path(where) / key), "train.max_steps": 4, "data.batch_size": 8,
                    "optim.lr": 1e-2, "parallel.strategy": strategy, "train.progress": False,
                    "train.eval_every": 0, "dist.device": "cpu"}, argv=[])
                said[key] = summary["train_loss"]
            except UserError as err:
                said[key] = str(err)
    return said


def test_a_shared_layer_checkpointed_reentrantly_is_one_line_under_ddp_and_fsdp(tmp_path):
    said = run_ranks(_fits, 2, str(tmp_path))[0]
    fix = "fix: use_reentrant=False in your torch.utils.checkpoint calls"
    assert said["ddp-reentrant"].startswith("DDP: a parameter's gradient arrived twice in one backward, as it does "
                                            "for a module run more than once a step") and fix in said["ddp-reentrant"]
    assert said["fsdp-reentrant"].startswith("parallel.strategy = fsdp: the gradients of blocks.0.0, blocks.0.2 "
                                             "reached them outside FSDP's reduce-scatter") and fix in said["fsdp-reentrant"]
    assert said["fsdp-plain"] == pytest.approx(said["ddp-plain"], rel=1e-5)
