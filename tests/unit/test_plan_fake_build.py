"""Models of one's own that fake tensors cannot simply build or run (plan/fake_build.py): one that reads a value
while it is built (timm's and transformers' stochastic-depth rates from torch.linspace, torch's trunc_normal_
init) is planned to the byte as the same model written with Python floats (drawn otherwise); one whose forward fake tensors cannot run (a mixture of experts'
routing: shapes that depend on the data) is one line from plan_fit, and a note, not a failure, in a finished
GPU run's plan vs actual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError

DIM, TOKENS = 16, 8


class Block(nn.Module):
    def __init__(self, drop: float, index: torch.Tensor) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = drop
        self.bias = nn.Parameter(torch.zeros(2 * TOKENS - 1))
        self.register_buffer("index", index, persistent=False)  # a relative-position index, as Swin's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.bias[self.index].view(TOKENS, TOKENS).softmax(-1)  # (T, T) mixing by relative position
        h = F.dropout(self.fc2(F.gelu(self.fc1(pos @ x))), self.drop, self.training)
        return x + h


class Net(nn.Module):
    """Four blocks whose dropout rates rise linearly, read from torch.linspace as timm reads its drop-path rates
    (``read``), or the same rates as Python floats; a relative-position index from torch.arange either way."""

    def __init__(self, read: bool = True) -> None:
        super().__init__()
        rates = [x.item() for x in torch.linspace(0.1, 0.4, 4)] if read else [0.1, 0.2, 0.3, 0.4]
        coords = torch.arange(TOKENS)
        index = (coords[:, None] - coords[None, :] + TOKENS - 1).flatten()
        self.embed = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(Block(r, index) for r in rates)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4) -> (B, 3)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


class Truncated(Net):
    """Net with its weights drawn by torch's nn.init.trunc_normal_, as transformers' ViT, DeiT and BEiT draw
    theirs: it redraws until every value is in range, reading them (a fake tensor has none)."""

    def __init__(self, truncated: bool = True) -> None:
        super().__init__(read=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init = nn.init.trunc_normal_ if truncated else nn.init.normal_
                init(module.weight, std=0.02)


class Routed(nn.Module):
    """A mixture of two experts, each token sent to its top expert: x[mask] has a shape the data decide."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gate, self.head = nn.Linear(4, DIM), nn.Linear(DIM, 2), nn.Linear(DIM, 3)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(0, 1)
        choice = self.gate(h).argmax(-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            mask = choice == i
            out[mask] = expert(h[mask])
        return self.head(out.view(x.shape[0], TOKENS, DIM).mean(1))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, TOKENS, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _plan(model, **config):
    from scaletrain import plan_fit

    return plan_fit(model, _data(), gpu="h100", show=False,
                    config={"dist.nproc": 2, "data.batch_size": 8, "train.max_steps": 10, **config})


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_model_reading_values_while_built_is_planned_as_the_same_model_with_floats(precision) -> None:
    with pytest.raises(Exception, match="local_scalar_dense"):  # what torch says of it on fake tensors alone
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            Net()
    read, floats = _plan(Net, **{"train.precision": precision}), _plan(lambda: Net(read=False),
                                                                       **{"train.precision": precision})
    assert read["model"] == floats["model"]
    assert read["model"]["activations"]["none"] > 0 and read["model"]["params"] == sum(
        p.numel() for p in Net().parameters())
    assert [r["total_bytes"] for r in read["layouts"]] == [r["total_bytes"] for r in floats["layouts"]]


def test_a_model_drawn_by_trunc_normal_is_planned_as_the_same_model_drawn_otherwise() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(Exception, match="local_scalar_dense"), FakeTensorMode():
        Truncated()
    assert _plan(Truncated)["model"] == _plan(lambda: Truncated(truncated=False))["model"]


def test_a_forward_fake_tensors_cannot_run_is_one_line_from_plan_fit() -> None:
    with pytest.raises(UserError) as caught:
        _plan(Routed)
    said = str(caught.value)
    assert len(said.splitlines()) == 1
    assert said.startswith("model: Routed cannot be planned: the plan runs one forward and backward of it on fake "
                           "tensors (shapes, no data), and an op of its forward makes a tensor whose shape depends "
                           "on the data (aten.nonzero.default"), said
    assert "fix: measure it in a real run instead" in said


def test_a_finished_gpu_runs_plan_vs_actual_notes_what_fake_tensors_cannot_run(monkeypatch) -> None:
    """fit() on a GPU compares the run with the plan of its model after training: a model the plan cannot run
    on fake tensors is a note there (model state still compared), not an exception at the end of a finished
    run. (The device's name is all it reads of the GPU here.)"""
    from scaletrain.batch import Batch
    from scaletrain.config import load
    from scaletrain.layout import Layout
    from scaletrain.observe import throughput
    from scaletrain.plan.actual import plan_vs_actual
    from scaletrain.plan.estimate import OWN

    monkeypatch.setattr(throughput, "device_peak", lambda *a, **k: ("NVIDIA H100 80GB HBM3", 989e12))
    model = Routed()
    x, _ = _data(1)
    state = {"params_bytes": 4 * sum(p.numel() for p in model.parameters())}
    state["grads_bytes"] = state["optim_bytes"] = state["params_bytes"]  # digits' SGD: one momentum buffer
    layout = Layout(strategy="ddp", world_size=1, nnodes=1, dp_replicate=1, dp_shard=1)
    record = plan_vs_actual(load("digits"), OWN, {"build": Routed}, Batch((x,), {}, None), None, model,
                            device=torch.device("cuda"), parallel=layout, batch_size=8, accum_steps=1, flops=1e6,
                            state=state, peak_bytes=10**8, step_s=0.01, mfu=0.3)
    assert any(n.startswith("activations and peak not planned: the plan runs the model on fake tensors, and an op "
                            "of its forward makes a tensor whose shape depends on the data") for n in record["notes"])
    assert record["error"]["model_state"] == pytest.approx(0, abs=1e-9)
    assert "peak" not in record["error"]
