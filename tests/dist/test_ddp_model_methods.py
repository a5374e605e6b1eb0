"""A loop that calls its model's own methods and attributes (model.generate(...), model.loss(x, y), model.vocab)
runs under DDP as it runs under FSDP and on one process, where the model set up is called bare; before, DDP's
wrapper stopped it: "'DistributedDataParallel' object has no attribute 'generate'". A method called with
gradients goes through DDP's forward, so its backward is all-reduced like a forward's."""

from __future__ import annotations

from pathlib import Path

import torch
from spawn_ranks import run_ranks
from torch import nn


class LM(nn.Module):
    vocab = 32

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(self.vocab, 16), nn.Linear(16, self.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # calls the model itself, as HF's do
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def generate(self, x: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            x = torch.cat([x, self(x)[:, -1].argmax(-1, keepdim=True)], 1)
        return x


def _train(rank: int, world: int, where: str, through: str) -> tuple[dict[str, torch.Tensor], list[int], int]:
    import scaletrain

    data = torch.randint(0, 32, (256, 9), generator=torch.Generator().manual_seed(0))
    cfg = {"run.dir": str(Path(where) / through), "train.max_steps": 4, "data.batch_size": 8, "train.progress": False,
           "optim.lr": 0.05}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(LM(), lambda p: torch.optim.SGD(p, lr=0.5))
        for x, y in st.loader((data[:, :-1], data[:, 1:])):
            with st.step():
                loss = model.loss(x, y) if through == "method" else \
                    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                st.backward(loss)
                opt.step()
                opt.zero_grad()
        sample = model.generate(torch.zeros(1, 1, dtype=torch.long), 4)[0].tolist()
        weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        return weights, sample, model.vocab


def test_a_models_own_methods_and_attributes_are_reached_through_ddp(tmp_path):
    forward = run_ranks(_train, 2, str(tmp_path), "forward")
    method = run_ranks(_train, 2, str(tmp_path), "method")
    for rank in (0, 1):  # the same steps as through forward, to the bit, and the same on both ranks: all-reduced
        for key, value in forward[0][0].items():
            assert torch.equal(method[rank][0][key], value), key
        assert method[rank][1] == forward[0][1] and len(method[rank][1]) == 5
        assert method[rank][2] == 32
