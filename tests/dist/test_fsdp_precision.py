"""bf16-mixed under FSDP for a model of one's own: what DDP's autocast gives it, on top of FSDP's policy.

FSDP's mixed-precision policy casts the gathered parameters to bf16; alone, a float the model makes inside
(``mask.float()`` into a Linear) met bf16 weights ("mat1 and mat2 must have the same dtype"), and a loss the
model computes itself (Hugging Face's) was computed on bf16 logits, on fp32 ones under DDP. A model of one's own
runs under autocast as well, as Lightning's and Accelerate's FSDP run it; scaletrain's own models, written for
the policy, run as they were (precision.policy_casts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn_ranks import run_ranks
from torch import nn


class Gated(nn.Module):
    """Two blocks (FSDP's units), a gate from a float made inside, and its own loss, as an HF model computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2)])
        self.gate = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.loss_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h * torch.sigmoid(self.gate((x > 0).float())))
        loss = F.cross_entropy(logits, labels)
        self.loss_dtypes.append(loss.dtype)
        return {"loss": loss, "logits": logits}


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    return [{"x": row, "labels": (row[:2].sum() > 0).long() + (row[2] > 1).long()} for row in x]


def _fit(rank: int, world: int, where: str, strategy: str) -> dict:
    import scaletrain

    torch.manual_seed(0)
    model = Gated()
    summary = scaletrain.fit(model, _data(), config={
        "run.dir": str(Path(where) / strategy), "train.max_steps": 6, "data.batch_size": 8, "optim.lr": 1e-2,
        "train.precision": "bf16-mixed", "parallel.strategy": strategy, "train.progress": False,
        "train.eval_every": 0, "dist.device": "cpu"})
    return {"loss": summary["train_loss"], "dtypes": sorted({str(d) for d in model.loss_dtypes})}


def test_a_model_of_ones_own_trains_in_bf16_under_fsdp_as_under_ddp(tmp_path):
    fsdp = run_ranks(_fit, 2, str(tmp_path), "fsdp")
    ddp = run_ranks(_fit, 2, str(tmp_path), "ddp")
    assert fsdp[0]["dtypes"] == ddp[0]["dtypes"] == ["torch.float32"]  # its own loss in fp32 under both
    # bf16 compute on both: the same 6 steps agree to bf16's rounding, not bit for bit
    assert fsdp[0]["loss"] == pytest.approx(ddp[0]["loss"], rel=0.02, abs=0.02)


class Spectral(nn.Module):
    """A Fourier layer as neural operators write it (the FNO paper's SpectralConv1d): complex weights on the low
    modes of an rFFT, beside real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(1, 4)
        self.spectral = nn.ModuleList([_Modes() for _ in range(2)])
        self.head = nn.Linear(4, 1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, 16, 1) -> (B, 16, 1)
        h = self.lift(u).transpose(1, 2)
        for layer in self.spectral:
            h = F.gelu(h + layer(h))
        return self.head(h.transpose(1, 2))


class _Modes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(0.1 * torch.rand(4, 4, 3, dtype=torch.cfloat))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ft = torch.fft.rfft(h.float())
        out = torch.zeros_like(ft)
        out[:, :, :3] = torch.einsum("bix,iox->box", ft[:, :, :3], self.weights)
        return torch.fft.irfft(out, n=h.shape[-1])


def _fit_spectral(rank: int, world: int, where: str, strategy: str, batch: int = 8) -> dict:
    import scaletrain

    torch.manual_seed(0)
    model = Spectral()
    g = torch.Generator().manual_seed(1)
    u = torch.randn(64, 16, 1, generator=g)
    summary = scaletrain.fit(model, (u, u.roll(1, dims=1)), loss_fn=F.mse_loss, config={
        "run.dir": str(Path(where) / f"s-{strategy}-{world}"), "train.max_steps": 4, "data.batch_size": batch,
        "optim.lr": 1e-2, "train.precision": "bf16-mixed", "parallel.strategy": strategy, "train.progress": False,
        "train.eval_every": 0, "dist.device": "cpu"})
    weights = {n: p for n, p in model.named_parameters() if p.is_complex()}
    return {"loss": summary["train_loss"], "complex": sorted(weights),
            "dtypes": sorted({str(p.dtype) for p in weights.values()})}


def test_complex_parameters_keep_their_dtype_under_fsdp_in_bf16(tmp_path):
    """The policy cast a unit's complex weights to bf16 (their imaginary part dropped) and reduced their complex
    gradients as fp32: the first backward stopped ("input types can't be cast to the desired output type
    Float"). A unit holding complex parameters keeps its dtypes under FSDP; autocast computes the rest in bf16."""
    fsdp = run_ranks(_fit_spectral, 2, str(tmp_path), "fsdp")
    one = _fit_spectral(0, 1, str(tmp_path), "ddp", batch=16)  # one process, the same 16 samples a step, autocast
    assert fsdp[0]["complex"] == one["complex"] == ["spectral.0.weights", "spectral.1.weights"]
    assert fsdp[0]["dtypes"] == one["dtypes"] == ["torch.complex64"]
    assert fsdp[0]["loss"] == pytest.approx(one["loss"], rel=0.02, abs=0.02)
