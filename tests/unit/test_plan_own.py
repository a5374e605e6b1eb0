"""scaletrain.plan_fit(): a model of one's own planned as `scaletrain plan` plans a recipe.

Its class is built on fake tensors and its first training sample, split as fit() splits it, measured there: the
step's bytes must be a real model's to the byte on a real sample (the same measurement on real tensors), and
transformers' Llama must plan as scaletrain's own Llama of the same shape does (the same parameters and FLOPs
exactly, the same model state; the activations of two implementations within 15%).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from warm import PYTHON

import scaletrain
from scaletrain.batch import Batcher, one_sample
from scaletrain.errors import UserError
from scaletrain.observe.memory import estimate_activation_bytes


class Tagger(nn.Module):
    """A model of one's own with keyword inputs, its loss inside when given labels (transformers' convention)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(3))
        self.head = nn.Linear(32, 5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        return {"logits": logits, **({"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}
                                     if labels is not None else {})}


def _samples(n: int) -> list[dict]:
    ids = torch.randint(0, 100, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row % 5} for row in ids]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_model_of_ones_own_is_planned_to_the_byte_of_a_real_step(precision: str, capsys) -> None:
    data = _samples(64)
    got = scaletrain.plan_fit(Tagger, data, gpu="h100", config={"dist.nproc": 4, "data.batch_size": 3,
                                                            "train.precision": precision, "train.epochs": 2})
    torch.manual_seed(0)
    real = Tagger()
    one = one_sample(Batcher(real), data)
    want = estimate_activation_bytes(real, one, 3, precision=precision, whole_step=True)
    rows = {(r["strategy"], r["checkpointing"]): r for r in got["layouts"]}
    assert rows["ddp", "none"]["activations_bytes"] == want
    assert got["model"]["params"] == sum(p.numel() for p in real.parameters())
    assert got["model"]["units"] == 3 and got["model"]["tokens_per_sample"] == 16  # its blocks, its token ids
    # 64 samples less fit()'s held-out 13 (20%, rounded up): 51 = 4 steps of 12 an epoch, 2 epochs
    assert got["total_steps"] == 8 and got["world_size"] == 4
    out = capsys.readouterr().out
    assert out.startswith("plan: Tagger on 1 x 4 h100, 8 steps") and "plan: use " in out


class Biased(Tagger):
    """Tagger given a per-batch tensor too: one (16, 32) position bias its collate_fn adds once per batch."""

    def forward(self, input_ids: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        return super().forward(input_ids, labels) if labels is None else \
            {"loss": F.cross_entropy(self.head(self.emb(input_ids) + bias).flatten(0, 1), labels.flatten())}


def _with_bias(samples: list[dict]) -> dict:
    return {**torch.utils.data.default_collate(samples), "bias": torch.ones(16, 32)}


def test_a_collate_fn_giving_a_tensor_once_per_batch_is_planned_as_a_real_step() -> None:
    """Its batch of one was repeated by stacking every tensor: the (16, 32) bias cannot be stacked to (3, 32)
    (a RuntimeError), and a collate of the copies ran on real tensors under the fake ones (an AssertionError)."""
    data = _samples(64)
    got = scaletrain.plan_fit(Biased, data, gpu="h100", collate_fn=_with_bias, show=False,
                              config={"dist.nproc": 4, "data.batch_size": 3})
    torch.manual_seed(0)
    real = Biased()
    want = estimate_activation_bytes(real, one_sample(Batcher(real), data, _with_bias), 3, whole_step=True)
    rows = {(r["strategy"], r["checkpointing"]): r for r in got["layouts"]}
    assert rows["ddp", "none"]["activations_bytes"] == want > 0


def test_transformers_llama_plans_as_scaletrains_own_llama_of_the_same_shape(tmp_path, capsys) -> None:
    """The same shape built two ways (scaletrain's Llama follows transformers' weights: tests/unit/test_llama.py):
    the parameters, FLOPs and model state agree exactly; the activations within 15% (two implementations:
    transformers' keeps 2.4-3.0% less here, 2-10% less at Llama 3 8B's shape: 34.09 against 34.90 GB for DDP)."""
    transformers = pytest.importorskip("transformers")
    from scaletrain.cli import main

    shape = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.zeros(40, 64, dtype=torch.long)
    own = scaletrain.plan_fit(lambda: transformers.LlamaForCausalLM(shape), [{"input_ids": r, "labels": r} for r in ids],
                          gpu="h100", config={"dist.nproc": 8, "data.batch_size": 2, "train.max_steps": 100})
    capsys.readouterr()
    assert main(["plan", "llama-tiny", "--gpu", "h100", "--nproc", "8", "--data.batch_size=2", "--data.seq_len=64",
                 "--model.n_embd=64", "--model.n_head=4", "--model.n_kv_head=2", "--model.ffn_hidden=192",
                 "--model.n_layer=2", "--model.vocab_size=256", "--train.max_steps=100",
                 f"--json={tmp_path / 'recipe.json'}"]) == 0
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert own["model"]["params"] == recipe["model"]["params"]
    assert own["model"]["flops_per_sample"] == pytest.approx(recipe["model"]["flops_per_sample"], rel=1e-9)
    for a, b in zip(own["layouts"], recipe["layouts"]):
        assert (a["strategy"], a["checkpointing"]) == (b["strategy"], b["checkpointing"])
        assert (a["params_bytes"], a["grads_bytes"], a["optim_bytes"]) == \
            (b["params_bytes"], b["grads_bytes"], b["optim_bytes"])
        assert a["activations_bytes"] == pytest.approx(b["activations_bytes"], rel=0.15), (a, b)


def test_what_cannot_be_planned_is_one_line() -> None:
    data = _samples(8)
    with pytest.raises(UserError, match=r"model: a Tagger already built; fix: pass its class, or a function of no "
                                        r"arguments that builds it"):
        scaletrain.plan_fit(Tagger(), data)
    with pytest.raises(UserError, match=r"gpu = 'h1000': expected one of h100, h200"):
        scaletrain.plan_fit(Tagger, data, gpu="h1000")
    with pytest.raises(UserError, match=r"model: Linear\(\) is called with no arguments .* fix: pass a function"):
        scaletrain.plan_fit(nn.Linear, data)  # needs its sizes


def test_an_uncaught_mistake_in_plan_fit_ends_as_fits_does(tmp_path) -> None:
    """plan_fit(...) with a batch larger than the data, or an unknown gpu, was a traceback and exit 1 where
    fit() says one line and exits 2; a caller can still catch the error."""
    import subprocess

    script = tmp_path / "plan_mine.py"
    script.write_text(
        "import sys, torch, scaletrain, scaletrain.errors\n"
        "x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))\n"
        "try:\n"
        "    scaletrain.plan_fit(lambda: torch.nn.Linear(4, 2), (x, y), gpu='rtx4090')\n"
        "except scaletrain.errors.UserError:\n"
        "    print('caught')\n"
        "scaletrain.plan_fit(lambda: torch.nn.Linear(4, 2), (x, y), config={'data.batch_size': 100000})\n",
        encoding="utf-8")
    proc = subprocess.run([*PYTHON, str(script)], capture_output=True, text=True, timeout=120, check=False,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stdout.strip() == "caught", proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("scaletrain: error: data.batch_size = 100000")


def test_a_split_the_plan_does_not_make_is_said_not_dropped(capsys) -> None:
    """parallel.tp = 2 given to plan_fit() planned DDP over all GPUs and said nothing of the tp asked for."""
    got = scaletrain.plan_fit(Tagger, _samples(64), gpu="h100", config={"dist.nproc": 4, "data.batch_size": 3,
                                                                        "parallel.tp": 2})
    assert got["world_size"] == 4
    said = " ".join(capsys.readouterr().out.split())
    assert ("plan: parallel.tp = 2 not planned: a model of one's own is planned with data parallelism (DDP, FSDP) "
            "over all 4 GPUs (the dp x tp x pp search covers the built-in GPT and Llama only)") in said


def test_fits_optimizer_and_dataloader_are_planned_as_fit_runs_them(capsys) -> None:
    """plan_fit() takes what fit() takes: an optimizer of one's own (SGD's one state buffer per parameter, not
    AdamW's two: the optimizer row halves) and a DataLoader (its batch size per rank)."""
    from torch.utils.data import DataLoader

    config = {"dist.nproc": 4, "data.batch_size": 3}
    adamw = scaletrain.plan_fit(Tagger, _samples(64), gpu="h100", config=config)
    sgd = scaletrain.plan_fit(Tagger, _samples(64), gpu="h100", config=config,
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    rows = {r["strategy"]: r for r in adamw["layouts"] if r["checkpointing"] == "none"}
    halved = {r["strategy"]: r for r in sgd["layouts"] if r["checkpointing"] == "none"}
    assert rows["ddp"]["optim_bytes"] == 2 * halved["ddp"]["optim_bytes"] > 0
    loaded = scaletrain.plan_fit(Tagger, DataLoader(_samples(64), batch_size=3, shuffle=True), gpu="h100",
                                 config={"dist.nproc": 4})
    assert loaded["layouts"] == adamw["layouts"] and loaded["total_steps"] == adamw["total_steps"]
    with pytest.raises(UserError, match=r"fit\(optimizer=...\): the function given returned a NoneType"):
        scaletrain.plan_fit(Tagger, _samples(64), gpu="h100", config=config, optimizer=lambda params: None)
    # a whole fit() call planned by its name alone (it was a TypeError for loss_fn): eval_data keeps all 64
    # samples for training, 5 steps of 12 in the epoch (4 of the 51 left when 13 are held out)
    whole = scaletrain.plan_fit(Tagger, _samples(64), eval_data=_samples(8), gpu="h100", config=config, show=False,
                                loss_fn=lambda out, y: out["loss"], metrics={"n": lambda out, y: y.float()},
                                scheduler=None, on_eval=None)
    assert (whole["total_steps"], adamw["total_steps"]) == (5, 4)
    assert [r["total_bytes"] for r in whole["layouts"]] == [r["total_bytes"] for r in adamw["layouts"]]


class WideHead(nn.Module):
    """Token ids to logits over 4,096 classes: a loss of one's own over them holds more than the model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(100, 32), nn.Linear(32, 4096)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _smoothed(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against one-hot targets, written out: the one-hot's float copy, the log-softmax and their
    product, each of the logits' size."""
    return -(F.one_hot(y, logits.shape[-1]).float() * F.log_softmax(logits, -1)).sum(-1).mean()


def test_fits_loss_fn_is_the_loss_the_planned_step_goes_backward_from() -> None:
    """plan_fit took loss_fn and measured the step from cross-entropy of the logits all the same: a loss whose
    temporaries outweigh the default's was planned as the default's (here 2.37 MB of a 3.15 MB step at batch 3:
    the one-hot's float copy beside the log-softmax and its gradient)."""
    ids = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(0))
    data = list(zip(ids, ids))
    config = {"dist.nproc": 2, "data.batch_size": 3}
    own = scaletrain.plan_fit(WideHead, data, gpu="h100", config=config, loss_fn=_smoothed, show=False)
    default = scaletrain.plan_fit(WideHead, data, gpu="h100", config=config, show=False)
    torch.manual_seed(0)
    real = WideHead()
    one = one_sample(Batcher(real), data)
    want = estimate_activation_bytes(real, one, 3, whole_step=True, loss_fn=_smoothed)
    rows = {(r["strategy"], r["checkpointing"]): r["activations_bytes"] for r in own["layouts"]}
    assert rows["ddp", "none"] == want
    logits_bytes = 3 * 16 * 4096 * 4
    assert want - estimate_activation_bytes(real, one, 3, whole_step=True) >= logits_bytes
    before = {(r["strategy"], r["checkpointing"]): r["activations_bytes"] for r in default["layouts"]}
    assert rows["ddp", "none"] - before["ddp", "none"] >= logits_bytes
    with pytest.raises(UserError, match=r"loss_fn: scaletrain calls loss_fn\(output, target\), and <lambda> cannot"):
        scaletrain.plan_fit(WideHead, data, gpu="h100", config=config, loss_fn=lambda out: out.sum(), show=False)
    with pytest.raises(UserError, match=r"loss_fn: <lambda> returned a tensor of shape \(1, 16\), not one number"):
        scaletrain.plan_fit(WideHead, data, gpu="h100", config=config, loss_fn=lambda out, y: out.sum(-1),
                            show=False)

    def logs(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # reads a value: fake tensors have none
        loss = _smoothed(out, y)
        print(f"loss {loss.item():.3f}")
        return loss

    with pytest.raises(UserError, match=r"^loss_fn: logs cannot be planned: .* it reads a tensor's value"):
        scaletrain.plan_fit(WideHead, data, gpu="h100", config=config, loss_fn=logs, show=False)


def test_strategy_auto_measures_the_step_of_fits_loss_fn() -> None:
    """fit()'s --parallel.strategy=auto weighed the activations of scaletrain's default loss, not the user's."""
    from scaletrain.config import ParallelConfig
    from scaletrain.observe.memory import fmt_bytes
    from scaletrain.parallel import resolve_strategy

    ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(0))
    real = WideHead()
    one = one_sample(Batcher(real), list(zip(ids, ids)))
    reasons = [resolve_strategy(real, ParallelConfig(strategy="auto"), world_size=1, sample=one, batch_size=3,
                                **kw)[1] for kw in ({}, {"loss_fn": _smoothed})]
    want = [estimate_activation_bytes(real, one, 3, **kw) for kw in ({}, {"loss_fn": _smoothed})]
    assert want[1] - want[0] >= 0.99 * 3 * 16 * 4096 * 4  # the one-hot's float copy, kept for backward
    for reason, acts in zip(reasons, want):
        assert f"activations {fmt_bytes(acts)} " in reason, reason


class MakesAFloat(nn.Module):
    """A float made inside forward ((x > 0).float()) into a Linear: fine under autocast, not on bf16 weights alone."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * torch.sigmoid(self.gate((x > 0).float()))


def test_the_fsdp_step_of_a_model_of_ones_own_is_measured_under_autocast_as_it_runs():
    """FSDP's activations are measured on a model built in bf16 (the policy's parameters); a model of one's own
    runs under autocast on top (precision.policy_casts), and the measure without it stopped on 'mat1 and mat2 must
    have the same dtype' for a float the model makes inside."""
    from scaletrain.batch import Batch
    from scaletrain.config import load
    from scaletrain.plan.estimate import _step_bytes

    cfg = load(None, {"train.precision": "bf16-mixed", "data.batch_size": 8})
    sample = Batch((torch.randn(1, 8),), {}, None)
    low, _ = _step_bytes(cfg, MakesAFloat().to(torch.bfloat16), sample, low=True, kept=False)
    high, _ = _step_bytes(cfg, MakesAFloat(), sample, low=False, kept=False)
    assert 0 < low < high  # DDP's autocast also keeps a bf16 copy of each fp32 weight for backward
