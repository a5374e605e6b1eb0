"""The built-in models' initial weights are drawn per parameter by name (models/init.py): a model built on the
meta device and materialized equals one built in memory, bitwise, and building either leaves the global generator
in the same place (so dropout and everything drawn after the build agree too)."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.models import GPT, Llama
from scaletrain.models.init import is_meta, materialize, param_seed

SHAPES = {"gpt": (GPT, (97, 16, 3, 4, 32)), "llama": (Llama, (97, 16, 3, 4, 2, 32))}


def _build(name: str, seed: int, meta: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    cls, args = SHAPES[name]
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = cls(*args)
    else:
        model = cls(*args)
    return model, torch.rand(4)  # what the global generator gives next


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_meta_built_and_materialized_equals_built_in_memory(name):
    real, after_real = _build(name, 0, meta=False)
    meta, after_meta = _build(name, 0, meta=True)
    assert is_meta(meta) and not is_meta(real)
    assert torch.equal(after_real, after_meta)  # the build drew the same from the global generator
    materialize(meta, torch.device("cpu"))
    assert not is_meta(meta)
    want, got = real.state_dict(), meta.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    for key in ("rope_cos", "rope_sin"):  # not in the state dict: recomputed
        if hasattr(real, key):
            assert torch.equal(getattr(real, key), getattr(meta, key))
    if name == "gpt":
        assert meta.head.weight is meta.tok_emb.weight and real.head.weight is real.tok_emb.weight


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_seed_decides_the_weights_and_the_rules_their_scale(name):
    a, _ = _build(name, 0, meta=False)
    b, _ = _build(name, 1, meta=False)
    assert not torch.equal(next(a.parameters()), next(b.parameters()))
    layers = 3
    for pname, p in a.named_parameters():
        if p.dim() == 1:  # norms' weights one, biases zero
            assert torch.equal(p, torch.ones_like(p) if pname.endswith("weight") else torch.zeros_like(p)), pname
            continue
        std = 0.02 / math.sqrt(2 * layers) if name == "gpt" and pname.endswith(("attn.proj.weight", "mlp.2.weight")) \
            else 0.02
        assert abs(p.std().item() / std - 1) < 0.1, (pname, p.std().item(), std)  # >= 1,024 draws each
        assert abs(p.mean().item()) < 4 * std / math.sqrt(p.numel())  # 4 standard errors


def test_parameters_of_one_shape_get_different_draws():
    model, _ = _build("llama", 0, meta=False)
    w1, w3 = model.layers[0].feed_forward.w1.weight, model.layers[0].feed_forward.w3.weight
    assert w1.shape == w3.shape and not torch.equal(w1, w3)
    assert len({param_seed(7, n) for n, _ in model.named_parameters()}) == len(list(model.parameters()))
