"""models.losses.linear_cross_entropy against F.cross_entropy of the full logits: the same loss and the same
gradients for h and W (fp64: to 1e-12; fp32: 1e-5), at chunk sizes that do and do not divide the rows, under
bf16 autocast within bf16's rounding, and inside the GPT's own head (tied weights) through gpu_mfu's smoke run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaletrain.models import GPT
from scaletrain.models.losses import linear_cross_entropy

ROOT = Path(__file__).resolve().parents[2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _reference(h, w, y, scale):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = F.cross_entropy((h @ w.T).flatten(0, -2), y.flatten())
    loss.backward(torch.tensor(scale, dtype=loss.dtype))
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_rows", [1, 7, 148, 10_000])
def test_same_loss_and_gradients_as_the_full_logits(dtype, tol, chunk_rows):
    g = torch.Generator().manual_seed(chunk_rows)
    h = torch.randn(4, 37, 16, dtype=dtype, generator=g, requires_grad=True)  # 148 rows
    w = torch.randn(101, 16, dtype=dtype, generator=g, requires_grad=True)
    y = torch.randint(0, 101, (4, 37), generator=g)
    ref_loss, ref_gh, ref_gw = _reference(h, w, y, 2.5)  # a loss scale: backward must multiply it in
    loss = linear_cross_entropy(h, w, y, chunk_rows=chunk_rows)
    loss.backward(torch.tensor(2.5, dtype=dtype))
    assert loss.dtype == dtype and h.grad.dtype == dtype and w.grad.dtype == dtype
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < tol
    assert _rel(h.grad, ref_gh) < tol
    assert _rel(w.grad, ref_gw) < tol


def test_bf16_autocast_matches_within_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(256, 64, generator=g, requires_grad=True)
    w = (0.1 * torch.randn(512, 64, generator=g)).requires_grad_()
    y = torch.randint(0, 512, (256,), generator=g)
    ref_loss, ref_gh, ref_gw = _reference(h.double(), w.double(), y, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y, chunk_rows=100)  # products in bf16, softmax in fp32
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32  # gradients in the parameters' dtype
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert _rel(h.grad.double(), ref_gh) < 2e-2
    assert _rel(w.grad.double(), ref_gw) < 2e-2


def test_gpt_head_fused_equals_logits_then_loss():
    torch.manual_seed(0)
    model = GPT(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32).double()
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    linear_cross_entropy(model.hidden(x), model.head.weight, y, chunk_rows=10).backward()
    for name, p in model.named_parameters():  # the tied embedding gets both of its gradients
        assert _rel(p.grad, ref[name]) < 1e-12, name


def test_without_gradients_the_loss_alone():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(50, 8, generator=g, dtype=torch.float64)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 30, (50,), generator=g)
    ref = F.cross_entropy(h @ w.T, y)
    assert abs(linear_cross_entropy(h, w, y, chunk_rows=7).item() - ref.item()) < 1e-12  # nothing requires grad
    with torch.no_grad():
        wg = w.clone().requires_grad_()
        out = linear_cross_entropy(h, wg, y, chunk_rows=7)
    assert not out.requires_grad and abs(out.item() - ref.item()) < 1e-12


def test_bad_chunk_rows():
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        linear_cross_entropy(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(2, dtype=torch.long), chunk_rows=0)


def test_gpu_mfu_smoke_with_the_fused_loss(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_mfu", ROOT / "benchmarks" / "gpu_mfu.py")
    gpu_mfu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_mfu", gpu_mfu)  # its dataclass looks its module up
    spec.loader.exec_module(gpu_mfu)
    out = tmp_path / "r.json"
    assert gpu_mfu.main(["--smoke", "--loss", "fused", "--chunk-rows", "50", "--residual", "bf16",
                         "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert (r["shape"], r["loss"], r["chunk_rows"], r["residual"]) == ("smoke", "fused", 50, "bf16")
    assert r["tokens_per_s"] > 0 and r["mem"]["params_bytes"] > 0
    capsys.readouterr()
    assert gpu_mfu.main(["--shape", "1b", "--loss", "fused"]) == 2
    assert "--loss fused calls the model's parts directly" in capsys.readouterr().err
