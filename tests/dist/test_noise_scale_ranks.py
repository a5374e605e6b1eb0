"""--log.grad_noise_scale in a run: the same B_simple from 2 data-parallel ranks (DDP's buckets, FSDP's
reduce-scatter inputs) as from one process accumulating the same micro-batches, and both equal to the estimator
applied by hand to gradients computed here (the weights held still: lr 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from spawn_ranks import run_ranks
from torch import nn

from scaletrain.observe.noise_scale import NoiseScale

B, STEPS, EVERY = 4, 4, 2  # per-micro-batch samples, optimizer steps, log interval


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 2 * B, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).reshape(8, 1) + 0.5 * torch.randn(STEPS * 2 * B, 1, generator=g)
    return x, y


def _one_process_order(x: torch.Tensor) -> torch.Tensor:
    """The samples in the order that makes one process's micro-batches the two ranks' batches: in each step's
    block of 2B positions rank 0 reads the even ones, rank 1 the odd ones (data/loader.py)."""
    blocks = x.reshape(STEPS, 2 * B, *x.shape[1:])
    return torch.cat([blocks[:, 0::2], blocks[:, 1::2]], dim=1).reshape(x.shape)


def _train(rank: int, world: int, run_dir: str, strategy: str) -> None:
    import scaletrain

    accum = 2 // world
    x, y = _data()
    if world == 1:
        x, y = _one_process_order(x), _one_process_order(y)
    cfg = {"run.dir": run_dir, "log.grad_noise_scale": True, "log.every": EVERY, "train.max_steps": STEPS,
           "data.shuffle": False, "train.progress": False, "parallel.strategy": strategy,
           "log.plan_vs_actual": False}
    with scaletrain.session(cfg) as st:
        torch.manual_seed(0)
        model, opt = st.setup(nn.Linear(8, 1), lambda params: torch.optim.SGD(params, lr=0.0))
        loader = st.loader(torch.utils.data.TensorDataset(x, y), batch_size=B, accum=accum)
        batches = iter(loader)
        while not st.done:
            with st.step():
                for _ in range(accum):
                    xb, yb = next(batches)
                    st.backward(nn.functional.mse_loss(model(xb), yb) / accum)
                st.optimizer_step(opt)
                opt.zero_grad(set_to_none=True)


def _records(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_noise_scale"] for r in rows if r["kind"] == "train"]


def _by_hand() -> list[float]:
    """B_simple after each interval: the micro-batches' gradients at the initial weights, through NoiseScale."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = _data()
    est, out = NoiseScale(decay=0.8), []
    for first in range(0, STEPS, EVERY):
        small, big = [], []
        for step in range(first, first + EVERY):
            grads = []
            for rank in range(2):
                rows = slice(step * 2 * B + rank, (step + 1) * 2 * B, 2)
                model.zero_grad()
                nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
            small += [float(g.square().sum()) for g in grads]
            big.append(float(((grads[0] + grads[1]) / 2).square().sum()))
        est.update(sum(small) / len(small), sum(big) / len(big), B, 2 * B)
        out.append(est.b_simple)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_measure_what_one_process_accumulating_measures(tmp_path: Path, strategy: str) -> None:
    run_ranks(_train, 2, str(tmp_path / "two"), strategy)
    _train(0, 1, str(tmp_path / "one"), "ddp")
    two, one = _records(tmp_path / "two"), _records(tmp_path / "one")
    assert len(two) == len(one) == STEPS // EVERY
    expected = _by_hand()
    for a, b, want in zip(two, one, expected):
        assert (a["b_small"], a["b_big"]) == (b["b_small"], b["b_big"]) == (B, 2 * B)
        for key in ("g2", "trace", "b_simple"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a, b)
        assert math.isclose(a["b_simple"], want, rel_tol=1e-5), (a, want)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())["grad_noise_scale"]
    assert math.isclose(summary["b_simple"], expected[-1], rel_tol=1e-5) and summary["global_batch"] == 2 * B
