"""A loop that calls its model's own methods and attributes (model.generate(...), model.vocab) runs under DDP as it
runs under FSDP and on one process, where the model set up is called bare; before, DDP's wrapper stopped it:
"'DistributedDataParallel' object has no attribute 'generate'". A method is called outside DDP's forward (which
holds collectives: one rank alone may call it); one that runs the model's forward with gradients, whose gradients
DDP would not average, is one line."""

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
        self.register_buffer("calls", torch.zeros(()))  # a buffer: DDP's forward broadcasts it, a collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # calls the model itself
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def generate(self, x: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            x = torch.cat([x, self(x)[:, -1].argmax(-1, keepdim=True)], 1)
        return x

    def describe(self) -> str:
        return f"{sum(p.numel() for p in self.parameters())} parameters"


def _train(rank: int, world: int, where: str) -> tuple[list[int], int, str, str]:
    import scaletrain
    from scaletrain.errors import UserError

    data = torch.randint(0, 32, (256, 9), generator=torch.Generator().manual_seed(0))
    cfg = {"run.dir": str(Path(where) / "lm"), "train.max_steps": 4, "data.batch_size": 8, "train.progress": False}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(LM(), lambda p: torch.optim.SGD(p, lr=0.5))
        for x, y in st.loader((data[:, :-1], data[:, 1:])):
            with st.step():
                st.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
                opt.step()
                opt.zero_grad()
        said = ""
        try:
            model.loss(x, y)
        except UserError as err:
            said = str(err)
        described = model.describe() if rank == 0 else ""  # one rank alone: no collective to wait in
        return model.generate(torch.zeros(1, 1, dtype=torch.long), 4)[0].tolist(), model.vocab, said, described


def test_a_models_own_methods_and_attributes_are_reached_through_ddp(tmp_path):
    per_rank = run_ranks(_train, 2, str(tmp_path), timeout_s=120)
    assert per_rank[0][0] == per_rank[1][0] and len(per_rank[0][0]) == 5
    assert per_rank[0][1] == per_rank[1][1] == 32
    for rank in (0, 1):
        assert per_rank[rank][2].startswith("model.loss() runs the model's forward with gradients outside DDP's "
                                            "forward, so its gradients would not be averaged over the ranks; fix:")
    assert per_rank[0][3] == f"{16 * 32 + 32 * 16 + 32} parameters"
