"""Parameters that some ranks' batches leave without a gradient (a mixture of experts: each sample goes to the
expert its gate picks). Under FSDP, fit() finds them on its first sample: the experts are kept out of FSDP's
units (a unit run by some ranks only gathers its parameters on those ranks alone) and every step
reduce-scatters zeros for a parameter a rank did not use. Before, Gloo aborted the process at the first
mismatched reduce-scatter ("Received data size doesn't match expected size"), and with the experts as units
the ranks waited on each other's all-gathers until the timeout."""

from __future__ import annotations

import contextlib
import io

import torch
from scratch import scratch_dir
from spawn_ranks import run_ranks
from torch import nn

import scaletrain
from scaletrain.sharded import plain


def route(h: torch.Tensor, gate: nn.Module, experts: nn.ModuleList, used: list[list[int]] | None = None) \
        -> torch.Tensor:
    """``h`` plus each sample's expert, the one ``gate`` scores highest, scaled by that score (so the gate
    learns); the experts it picked appended to ``used``."""
    w = gate(h).softmax(-1)
    top = w.argmax(-1)
    mix = torch.zeros_like(h)
    for e in top.unique().tolist():
        pick = top == e
        mix[pick] = w[pick, e, None] * experts[e](h[pick])
    if used is not None:
        used.append(sorted(top.unique().tolist()))
    return h + mix


class Routed(nn.Module):
    """Four experts in a ModuleList beside the layers that always run (route()). ``used``: the experts of each
    forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gate, self.head = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.used: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(route(self.inp(x), self.gate, self.experts, self.used))


def _fit(rank: int, world: int, strategy: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    model = Routed()
    said = io.StringIO()
    # SGD without momentum or weight decay: a zero gradient (FSDP's, for an expert no rank used) and none
    # (DDP's) leave a parameter alike, so the three runs can be compared weight for weight
    with contextlib.redirect_stdout(said):
        scaletrain.fit(model, (x, y), argv=[], config={
            "run.dir": scratch_dir(), "train.max_steps": 12, "data.batch_size": 4 // world, "data.val_fraction": 0,
            "optim.name": "sgd", "optim.momentum": 0.0, "optim.weight_decay": 0.0, "optim.lr": 0.2,
            "schedule.warmup_steps": 0, "train.progress": False, "parallel.strategy": strategy,
            "parallel.find_unused": strategy == "ddp" and world > 1})
    weights = {k: plain(v).detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "used": model.used, "said": said.getvalue()}


def test_experts_some_ranks_leave_unused_train_under_fsdp_as_under_ddp_and_one_process() -> None:
    one = _fit(0, 1, "ddp")
    ddp = run_ranks(_fit, 2, "ddp", timeout_s=120)
    fsdp = run_ranks(_fit, 2, "fsdp", timeout_s=120)
    # the ranks' batches went to different experts in some steps (the first forward, the same sample on both, aside)
    steps = list(zip(fsdp[0]["used"][1:], fsdp[1]["used"][1:]))
    assert len(steps) == 12 and sum(a != b for a, b in steps) >= 8, steps  # 11 of 12 with these seeds
    said = fsdp[0]["said"]
    assert "FSDP: inp, gate, head + root" in said, said  # the experts stay with the root: gathered on every rank
    assert "parameters got no gradient from the first sample (experts." in said, said
    for name, want in one["weights"].items():
        for run in (ddp[0], fsdp[0], fsdp[1]):
            assert torch.allclose(run["weights"][name], want, rtol=1e-5, atol=1e-6), name
    # the experts did train (a comparison of untouched weights would prove nothing)
    torch.manual_seed(0)
    start = Routed()
    moved = [i for i in range(4) if not torch.equal(one["weights"][f"experts.{i}.weight"], start.experts[i].weight)]
    assert len(moved) >= 2, moved


class Mixture(nn.Module):
    """A block of the mixture: the residual stream plus its experts, routed as Routed's (no head)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return route(h, self.gate, self.experts)


def _session(rank: int, world: int, strategy: str, find_unused: bool) -> dict:
    """A loop of one's own (no first sample looked at) over two Mixture blocks, FSDP's units."""
    torch.manual_seed(0)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(8, 16), Mixture(), Mixture(), nn.Linear(16, 2))
    sgd = lambda params: torch.optim.SGD(params, lr=0.2)
    with scaletrain.session({"run.dir": scratch_dir(), "train.max_steps": 8, "train.progress": False,
                             "parallel.strategy": strategy, "parallel.find_unused": find_unused}, argv=[]) as st:
        net, opt = st.setup(model, sgd)
        for xb, yb in st.loader((x, y), batch_size=4 // world):
            with st.step():
                opt.zero_grad(set_to_none=True)
                st.backward(nn.functional.cross_entropy(net(xb), yb))
                opt.step()
            if st.done:
                break
    return {k: plain(v).detach().clone() for k, v in model.state_dict().items()}


def test_find_unused_under_fsdp_in_a_loop_of_ones_own() -> None:
    """--parallel.find_unused=true under FSDP (a session has no first sample to find them by): the blocks are
    the units, and their experts' zero gradients are reduce-scattered; the weights are one process's."""
    one = _session(0, 1, "ddp", False)
    fsdp = run_ranks(_session, 2, "fsdp", True, timeout_s=120)
    for name, want in one.items():
        assert torch.allclose(fsdp[0][name], want, rtol=1e-5, atol=1e-6), name
