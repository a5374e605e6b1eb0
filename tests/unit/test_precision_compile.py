"""torch.compile and bf16 autocast change how the step is computed, not what it computes."""

from __future__ import annotations

import tempfile

import pytest
import torch

from scaletrain import runtime
from scaletrain.config import load
from scaletrain.data import digits
from scaletrain.train.precision import autocast, grad_scaler
from scaletrain.train.run import open_stepper, step

STEPS = 20


def _train(**overrides):
    cfg = load(None, {"model.name": "mlp", "optim.name": "sgd", "optim.lr": 0.1, "dist.device": "cpu",
                      "run.dir": tempfile.mkdtemp(prefix="scaletrain-test-"), **overrides})
    job, batches = open_stepper(cfg, runtime.init(cfg.dist), digits(0.2))
    losses = [step(job, batches).item() for _ in range(STEPS)]
    job.st.close(finished=False)
    return losses, {k: v.detach().clone() for k, v in job.module.state_dict().items()}


def test_compiled_training_matches_eager():
    eager_losses, eager = _train()
    compiled_losses, compiled = _train(**{"train.compile": True})
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    for name, ref in eager.items():  # measured: worst 4.9e-7 relative after 20 steps
        assert ((compiled[name] - ref).norm() / ref.norm()).item() < 1e-5, name


def test_bf16_autocast_tracks_fp32():
    fp32_losses, _ = _train()
    bf16_losses, bf16 = _train(**{"train.precision": "bf16-mixed"})
    assert bf16_losses != fp32_losses  # it did run in lower precision
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.03)  # bf16 keeps 8 mantissa bits
    assert all(v.dtype == torch.float32 for v in bf16.values())  # master weights stay fp32


def test_autocast_and_scaler_choices():
    cpu = torch.device("cpu")
    with autocast("bf16-mixed", cpu):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast("fp32", cpu):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    assert not grad_scaler("bf16-mixed", cpu).is_enabled()


@pytest.mark.parametrize(("avx512_bf16", "amx", "precision", "device", "warned"), [
    (False, False, "bf16-mixed", "cpu", True),  # this VM: AVX2 only
    (True, False, "bf16-mixed", "cpu", False),
    (False, True, "bf16-mixed", "cpu", False),
    (False, False, "fp32", "cpu", False),
    (False, False, "bf16-mixed", "cuda", False),
])
def test_bf16_on_a_cpu_without_bf16_instructions_is_named_slow(monkeypatch, avx512_bf16, amx, precision, device,
                                                                warned):
    from scaletrain.train.precision import slow_here

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    said = slow_here(precision, torch.device(device))
    assert bool(said) == warned
    if warned:
        assert said.endswith("fix: --train.precision=fp32 on this machine") and "\n" not in said
