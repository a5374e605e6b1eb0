"""Learning-rate rules: Goyal et al.'s table and the warmup/decay schedules."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from scaletrain.config import ScheduleConfig, load
from scaletrain.schedule import WarmupDecay
from scaletrain.train.batching import plan_batches
from scaletrain.train.lr import build_scheduler, scaled_lr


@pytest.mark.parametrize("ranks, global_batch, lr", [
    (8, 256, 0.1), (16, 512, 0.2), (32, 1024, 0.4), (64, 2048, 0.8), (128, 4096, 1.6), (256, 8192, 3.2),
])
def test_goyal_et_al_linear_scaling_table(ranks, global_batch, lr):
    # ResNet-50 on ImageNet: 32 images per GPU, lr 0.1 at a global batch of 256 (Goyal et al. 2017, Table 2).
    cfg = load(None, {"data.batch_size": 32, "optim.lr": 0.1, "optim.base_batch": 256, "optim.scale_lr": True})
    plan = plan_batches(cfg, world_size=ranks, train_size=1_281_167)
    assert plan.global_batch == global_batch
    assert plan.peak_lr == pytest.approx(lr, rel=1e-12)
    assert scaled_lr(0.1, global_batch, 256) == pytest.approx(lr, rel=1e-12)


def test_without_the_rule_lr_is_the_base():
    cfg = load(None, {"data.batch_size": 32, "optim.lr": 0.1})
    assert plan_batches(cfg, world_size=64, train_size=100_000).peak_lr == 0.1


def test_warmup_then_cosine():
    f = WarmupDecay(ScheduleConfig(warmup_steps=10, warmup_start=0.1, decay="cosine", min_lr_ratio=0.1), 110)
    assert f(0) == pytest.approx(0.1) and f(5) == pytest.approx(0.55) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f(110) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_linear_step_and_constant_decay():
    assert WarmupDecay(ScheduleConfig(decay="linear"), 100)(50) == pytest.approx(0.5)
    step = WarmupDecay(ScheduleConfig(warmup_steps=4, decay="step", step_every=10, gamma=0.5), 100)
    assert [step(s) for s in (4, 13, 14, 24, 34)] == [1.0, 1.0, 0.5, 0.25, 0.125]
    assert WarmupDecay(ScheduleConfig(decay="constant", warmup_steps=2), 100)(99) == 1.0


def test_scheduler_drives_the_optimizer_and_survives_a_state_dict_round_trip():
    def make():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
        return opt, build_scheduler(opt, ScheduleConfig(warmup_steps=4, decay="cosine"), total_steps=20)

    opt, sched = make()
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert lrs[12] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    opt2, sched2 = make()
    state = sched.state_dict()
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]
    assert sched2.last_epoch == 20 and sched2.get_last_lr() == sched.get_last_lr()
