"""A model with an nn.Embedding(sparse=True) (word2vec-style and recommender models) died in the gradient-norm
clipping, torch's clip_grad_norm_ having no sparse kernel, with a screenful of dispatch keys; then in the memory
count (a sparse gradient has no storage). It trains now with an optimizer that takes sparse gradients, as the
same model with a dense embedding does; what cannot take them (AdamW, weight decay, FSDP) is one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch
from spawn_ranks import run_ranks, script_env
from torch import nn
from warm import PYTHON, SCALETRAIN_M

import scaletrain


class Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 8, sparse=sparse)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (256, 6), generator=torch.Generator().manual_seed(1))
    return ids, (ids[:, 0] < 32).long()


RUN = {"train.max_steps": 6, "train.progress": False, "optim.name": "sgd", "optim.lr": 0.5, "optim.momentum": 0.9,
       "data.batch_size": 16, "train.eval_batches": 1}


def _both(rank: int, world: int, root: str, clip: float, more: dict | None = None) -> list[dict[str, torch.Tensor]]:
    out = []
    for sparse in (True, False):
        run = f"{root}/{'sparse' if sparse else 'dense'}-{world}"
        scaletrain.fit(Bag(sparse), _data(), loss_fn=nn.functional.cross_entropy,
                       config={**RUN, "optim.grad_clip": clip, "run.dir": run, **(more or {})})
        out.append(safetensors.torch.load_file(f"{run}/model.safetensors"))
    return out


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_a_sparse_embedding_trains_as_a_dense_one_on_one_process(tmp_path: Path, clip: float) -> None:
    """6 SGD steps with momentum; clip 0.05 clips every step (the norm is the coalesced values', a row drawn
    twice counted once): the same weights as the dense embedding's within 1e-6 (other summation orders)."""
    sparse, dense = _both(0, 1, str(tmp_path), clip)
    assert sorted(sparse) == sorted(dense) == ["emb.weight", "head.bias", "head.weight"]
    assert not torch.equal(sparse["emb.weight"], Bag(True).emb.weight.detach())  # it trained
    assert max((sparse[k] - dense[k]).abs().max().item() for k in sparse) < 1e-6


def test_a_sparse_embedding_trains_as_a_dense_one_under_ddp(tmp_path: Path) -> None:
    """DDP all-reduces the sparse gradient (Gloo) and averages it as the dense one: the same weights. With the
    gradient noise scale on, which read the norm of each DDP bucket (a sparse one had no norm kernel)."""
    sparse, dense = run_ranks(_both, 2, str(tmp_path), 0.05, {"log.grad_noise_scale": True}, timeout_s=180)[0]
    assert max((sparse[k] - dense[k]).abs().max().item() for k in sparse) < 1e-6


SCRIPT = """
import sys, torch
from torch import nn
import scaletrain
from test_sparse_embeddings import Bag, _data
scaletrain.fit(Bag(True), _data(), loss_fn=nn.functional.cross_entropy,
               config={"train.max_steps": 2, "train.progress": False, "run.dir": sys.argv[1]})
"""


@pytest.mark.parametrize(("argv", "said"), [
    ([], ("scaletrain: error: optim.name = 'adamw': expected an optimizer that takes sparse gradients, which emb "
         "(Embedding(sparse=True)) gives; fix: --optim.name=sgd, sparse=False on the embedding, or "
         "fit(optimizer=...) with torch.optim.SparseAdam for its parameters")),
    (["--optim.name=sgd", "--optim.weight_decay=0.1"],
     ("scaletrain: error: optim.weight_decay = 0.1: expected 0 with sparse gradients, which emb "
     "(Embedding(sparse=True)) gives (SGD cannot decay them); fix: --optim.weight_decay=0, or sparse=False on "
     "the embedding")),
    (["--nproc", "2", "--optim.name=sgd", "--parallel.strategy=fsdp"],
     ("scaletrain: error: parallel.strategy = 'fsdp': expected a model without sparse gradients to shard (emb "
     "(Embedding(sparse=True)) gives them, which FSDP cannot shard); fix: --parallel.strategy=ddp, or "
     "sparse=False on the embedding")),
])
def test_what_cannot_take_sparse_gradients_is_one_line(tmp_path: Path, argv: list[str], said: str) -> None:
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    env = {**script_env(), "PYTHONPATH": str(Path(__file__).parent) + ":" + str(Path(__file__).parents[1])}
    launcher = [*SCALETRAIN_M, "launch", "--nproc", "2"] if "--nproc" in argv else PYTHON
    rest = [a for a in argv if a not in ("--nproc", "2")]
    proc = subprocess.run([*launcher, str(script), str(tmp_path / "run"), *rest], capture_output=True, text=True,
                          env=env, timeout=180, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert said in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
