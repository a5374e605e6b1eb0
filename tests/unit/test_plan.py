"""scaletrain plan: memory per GPU per layout, time and cost, and the choice, before a run.

The plan builds the model on fake tensors; what it measures there must be what a real model has: the
peak bytes of a real forward and backward beyond the model state to the byte, the model state of a real model after a real AdamW step to the
byte. The arithmetic of time and communication is checked against the formulas the docs state, and the
seed's example (an ~7B model with AdamW in fp32: 16 bytes per parameter before activations) against H100s.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import load
from scaletrain.data import build_splits
from scaletrain.models import build_model
from scaletrain.observe.memory import estimate_activation_bytes, model_state_bytes
from scaletrain.plan.catalog import ACCELERATORS
from scaletrain.plan.estimate import layout, make_plan, measure_model

SMALL = {"data.batch_size": 3, "data.seq_len": 64, "model.n_layer": 2, "model.n_embd": 64, "model.n_head": 4}
BIG = {"model.n_layer": 32, "model.n_embd": 4096, "model.n_head": 32, "model.vocab_size": 50304,
       "data.seq_len": 2048, "data.batch_size": 1}


def _facts(overrides: dict, recipe: str = "gpt-stdlib"):
    cfg = load(recipe, cli_overrides=overrides)
    splits = build_splits(cfg.data, cfg.model)
    sample = splits.train[0][0]
    return cfg, splits, sample, measure_model(cfg, splits.task, splits.info, sample)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_activations_on_fake_tensors_are_the_bytes_of_a_real_step(precision):
    cfg, splits, sample, facts = _facts({**SMALL, "train.precision": precision})
    real = build_model(cfg.model, splits.task, splits.info)
    assert facts.activations["none"] == estimate_activation_bytes(real, sample, 3, precision=precision,
                                                                  whole_step=True)
    if precision == "bf16-mixed":  # as FSDP runs it: bf16 parameters, no autocast copies of the weights
        low = build_model(cfg.model, splits.task, splits.info).to(torch.bfloat16)
        assert facts.activations["sharded-none"] == estimate_activation_bytes(low, sample, 3, whole_step=True)
        assert facts.activations["sharded-none"] < facts.activations["none"]
    assert facts.activations["full"] < facts.activations["none"]
    assert facts.units == 2 and facts.tokens_per_sample == 64


def test_model_state_is_what_a_real_model_holds_after_an_adamw_step():
    cfg, splits, _, facts = _facts(SMALL)
    model = build_model(cfg.model, splits.task, splits.info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.stack([splits.train[i][0] for i in range(3)]), torch.stack([splits.train[i][1] for i in range(3)])
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    live = model_state_bytes(model, opt)
    plan = make_plan(load("gpt-stdlib", cli_overrides={**SMALL, "dist.nproc": 4}), facts, ACCELERATORS["h100"],
                     total_steps=10, accum_steps=1, mfu=0.4, net_bytes_per_s=50e9, price_per_gpu_hour=None)
    ddp, fsdp = plan.layouts[0], plan.layouts[2]
    assert (ddp.strategy, fsdp.strategy) == ("ddp", "fsdp")
    # AdamW's step counters are 0-d tensors (4 bytes each): the plan counts the two moments per parameter
    steps = sum(4 for s in opt.state.values())
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optim_bytes + steps) == \
        (live.params_bytes, live.grads_bytes, live.optim_bytes)
    assert (fsdp.params_bytes, fsdp.grads_bytes, fsdp.optim_bytes) == \
        tuple(math.ceil(b / 4) for b in (ddp.params_bytes, ddp.grads_bytes, ddp.optim_bytes))
    # two units all-gathered (fp32 here) and one unit's fp32 gradients
    assert ddp.fsdp_buffers_bytes == 0 and fsdp.fsdp_buffers_bytes == facts.largest_unit * (2 * 4 + 4)


def test_time_and_communication_follow_the_stated_formulas():
    facts = _facts(SMALL)[3]
    kw = {"acc": ACCELERATORS["h100"], "precision": "fp32", "batch_size": 3, "optimizer": "adamw", "mfu": 0.5,
          "net_bytes_per_s": 50e9}
    one = layout(facts, "ddp", "none", gpus_per_node=8, nodes=1, accum_steps=2, **kw)
    assert one.compute_s == pytest.approx(facts.flops_per_sample * 3 * 8 * 2 / (8 * 494e12 * 0.5), rel=1e-12)
    assert one.comm_s == pytest.approx(2 * 7 / 8 * 4 * facts.trainable / 450e9, rel=1e-12)
    full = layout(facts, "ddp", "full", gpus_per_node=8, nodes=1, accum_steps=2, **kw)
    assert full.compute_s == pytest.approx(one.compute_s * 4 / 3, rel=1e-12)  # one more forward
    fsdp = layout(facts, "fsdp", "none", gpus_per_node=8, nodes=1, accum_steps=2, **kw)
    # per micro-step two all-gathers (fp32 here), once per step the reduce-scatter
    assert fsdp.comm_s == pytest.approx((2 * 2 * 7 / 8 * 4 * facts.params + 7 / 8 * 4 * facts.trainable) / 450e9,
                                        rel=1e-12)
    two = layout(facts, "ddp", "none", gpus_per_node=8, nodes=2, accum_steps=2, **kw)
    assert two.comm_s == pytest.approx(2 * 15 / 16 * 4 * facts.trainable / 50e9, rel=1e-12)  # the slower link
    assert two.step_s == max(two.compute_s, two.comm_s)
    hsdp = layout(facts, "hsdp", "none", gpus_per_node=8, nodes=2, accum_steps=2, **kw)
    # shard within a machine over NVLink, all-reduce one shard's gradients between the 2 machines
    within = (2 * 2 * 7 / 8 * 4 * facts.params + 7 / 8 * 4 * facts.trainable) / 450e9
    assert hsdp.comm_s == pytest.approx(within + 2 * 1 / 2 * 4 * facts.trainable / 8 / 50e9, rel=1e-12)
    assert hsdp.params_bytes == math.ceil(4 * facts.params / 8)  # sharded over the 8 GPUs of a machine


def test_the_seeds_large_model_needs_sharding_on_h100s():
    facts = _facts(BIG)[3]
    assert 6.6e9 < facts.params < 6.7e9
    h100 = ACCELERATORS["h100"]

    def plan(gpus: int):
        c = load("gpt-stdlib", cli_overrides={**BIG, "dist.nproc": gpus})
        return make_plan(c, facts, h100, total_steps=1000, accum_steps=1, mfu=0.4, net_bytes_per_s=50e9,
                         price_per_gpu_hour=2.0)

    eight = plan(8)
    ddp = eight.layouts[0]
    assert ddp.params_bytes + ddp.grads_bytes + ddp.optim_bytes == 16 * facts.params  # 4 + 4 + 2 x 4 bytes
    assert not ddp.fits and eight.choice is not None and eight.choice.strategy == "fsdp"
    assert "ddp does not fit" in eight.reason
    assert eight.cost(eight.choice) == pytest.approx(1000 * eight.choice.step_s / 3600 * 8 * 2.0)
    alone = plan(1)
    assert alone.choice is None and "fits on" in alone.reason
    need = int(alone.reason.rsplit("fits on ", 1)[1].split()[0])
    kw = {"acc": h100, "nodes": 1, "precision": "fp32", "batch_size": 1, "accum_steps": 1, "optimizer": "adamw",
          "mfu": 0.4, "net_bytes_per_s": 50e9}
    assert layout(facts, "fsdp", "full", gpus_per_node=need, **kw).fits
    assert not layout(facts, "fsdp", "full", gpus_per_node=need - 1, **kw).fits


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-stdlib", "--gpu", "a100-40gb", "--nproc", "4", "--price", "1.5", "--json", str(out),
                 *(f"--{k}={v}" for k, v in SMALL.items())]) == 0
    text = capsys.readouterr().out
    assert "plan: use ddp" in text and "a100-40gb" in text
    data = json.loads(out.read_text())
    assert [(r["strategy"], r["checkpointing"]) for r in data["layouts"]] == \
        [("ddp", "none"), ("ddp", "full"), ("fsdp", "none"), ("fsdp", "full")]
    assert data["world_size"] == 4 and data["global_batch"] == 12 and data["choice"]["strategy"] == "ddp"
    assert data["layouts"][0]["cost"] == pytest.approx(data["layouts"][0]["run_hours"] * 4 * 1.5)


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "tpu"], ["--gpu = 'tpu'", "expected one of h100, h200", "fix: --gpu h100"]),
    (["--mfu", "0"], ["--mfu = '0'", "expected a number in (0, 1]", "fix: --mfu 0.4"]),
    (["--mfu", "1.5"], ["--mfu = '1.5'"]),
    (["--price", "free"], ["--price = 'free'", "fix: --price 2.5"]),
    (["--model.n_head=5"], ["model.n_head = 5", "a divisor of model.n_embd"]),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert main(["plan", "gpt-stdlib", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
