"""The built-in GPT's speed keys (model.bias, model.loss, model.residual) through the trainer's own step: off,
they are exactly the model as it was; on, they compute the same training within a stated tolerance."""

from __future__ import annotations

import pytest
import torch
from scratch import scratch_dir

from scaletrain import runtime
from scaletrain.config import load
from scaletrain.data import build_splits
from scaletrain.errors import ConfigError
from scaletrain.models import build_model
from scaletrain.train.run import open_stepper, step

TINY = {"data.source": "stdlib", "model.name": "gpt", "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2,
        "data.seq_len": 32, "data.batch_size": 4, "dist.device": "cpu", "optim.lr": 3e-3}
STEPS = 5


def _train(**overrides):
    cfg = load(None, {**TINY, **overrides, "run.dir": scratch_dir()})
    job, batches = open_stepper(cfg, runtime.init(cfg.dist), build_splits(cfg.data, cfg.model))
    losses = [step(job, batches).item() for _ in range(STEPS)]
    job.st.close(finished=False)
    return losses, {k: v.detach().clone() for k, v in job.module.state_dict().items()}, job


def test_off_is_the_model_as_it_was():
    """The keys at their defaults, given explicitly: the same parameters, the same forward (logits, also when
    targets are passed: only a fused loss takes them) and a bit-identical training."""
    losses, weights, job = _train()
    same_losses, same, _ = _train(**{"model.bias": True, "model.loss": "split", "model.residual": "fp32"})
    assert same_losses == losses and all(torch.equal(same[k], weights[k]) for k in weights)
    assert sum(k.endswith(".bias") for k in weights) == 2 * 6 + 1  # per block: 2 norms, qkv, proj, 2 mlp; ln_f
    assert job.batcher.target_kwarg is None
    x = torch.randint(0, 256, (2, 32))
    assert torch.equal(job.module(x), job.module(x, x)) and job.module(x).shape == (2, 32, 256)


def test_a_fused_loss_trains_as_the_split_one():
    """model.loss=fused: the model is given the targets and returns its loss, the logits never kept whole; the
    losses and the weights after 5 AdamW steps agree with the split loss's (fp32; measured: losses within 4.8e-7,
    weights within 5.5e-6: AdamW's first steps move every weight by about lr whatever the gradient's rounding)."""
    split_losses, split, _ = _train()
    fused_losses, fused, job = _train(**{"model.loss": "fused"})
    assert job.batcher.target_kwarg == "targets" and job.tokens_per_sample == 32
    assert fused_losses == pytest.approx(split_losses, rel=1e-5, abs=1e-6)
    for name, ref in split.items():
        assert torch.allclose(fused[name], ref, rtol=1e-4, atol=1e-5), name


def test_no_bias_drops_exactly_the_biases():
    cfg = load(None, TINY)
    with_bias = build_model(cfg.model, "lm", {"vocab_size": 256, "seq_len": 32})
    bare = build_model(load(None, {**TINY, "model.bias": False}).model, "lm", {"vocab_size": 256, "seq_len": 32})
    biases = sum(p.numel() for n, p in with_bias.named_parameters() if n.endswith(".bias"))
    assert not any(n.endswith(".bias") for n, _ in bare.named_parameters())
    assert sum(p.numel() for p in bare.parameters()) == sum(p.numel() for p in with_bias.parameters()) - biases
    losses, _, _ = _train(**{"model.bias": False})
    assert losses[-1] < losses[0]


def test_a_bf16_residual_tracks_the_fp32_one_and_needs_bf16_compute():
    """model.residual=bf16 under bf16 autocast (on the CPU here): the stream between blocks is bf16, the
    training within bf16's rounding of autocast's fp32 stream; without bf16 compute it is refused in one line."""
    fp32_losses, _, _ = _train(**{"train.precision": "bf16-mixed"})
    bf16_losses, weights, job = _train(**{"train.precision": "bf16-mixed", "model.residual": "bf16"})
    assert bf16_losses != fp32_losses and bf16_losses == pytest.approx(fp32_losses, rel=0.02)
    assert all(v.dtype == torch.float32 for v in weights.values())  # the master weights stay fp32
    seen = []
    hook = job.module.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        job.module(torch.randint(0, 256, (1, 32)))
    hook.remove()
    assert seen == [torch.bfloat16]
    with pytest.raises(ConfigError, match=r"model.residual = 'bf16': expected fp32 or auto unless train.precision is "
                                          r"bf16-mixed .* fix: --train.precision=bf16-mixed"):
        load(None, {**TINY, "model.residual": "bf16"})


@pytest.mark.parametrize(("recipe", "params"), [("gpt2-124m", 124_439_808), ("gpt2-350m", 354_823_168),
                                                ("gpt2-774m", 774_030_080), ("gpt2-1.5b", 1_557_611_200)])
def test_the_gpt2_recipes_have_the_published_models_parameter_counts(recipe, params):
    """GPT-2 small, medium, large and XL as transformers' GPT2LMHeadModel counts them (tied head, biases, learned
    positions for 1,024 tokens), from the recipes' shapes on the meta device: the planner's named shapes."""
    cfg = load(recipe)
    with torch.device("meta"):
        model = build_model(cfg.model, "lm", {"vocab_size": 256, "seq_len": cfg.data.seq_len})
    assert sum(p.numel() for p in model.parameters()) == params
