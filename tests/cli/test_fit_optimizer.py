"""fit(optimizer=..., scheduler=...): the user's own optimizer and LR schedule in place of optim.* and
schedule.*, as Accelerate's prepare() and Lightning's configure_optimizers() take them: trained as given,
resumed exactly, given the sharded parameters under FSDP, and the mistakes one line each."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import run_ranks
from torch import nn
from warm import PYTHON

import scaletrain
from scaletrain.errors import CheckpointError, Stopped, UserError

QUICK = {"train.epochs": 2, "data.batch_size": 32, "optim.lr": 1e-2, "train.progress": False, "log.every": 1}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] + x[:, 1] > 0).long()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.fc(h))


class Net(nn.Module):
    """Repeated blocks (FSDP units), and nanoGPT's configure_optimizers: decay on matrices, Adam's betas."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp, self.blocks, self.out = nn.Linear(8, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                 lr=lr, betas=(0.9, 0.95))


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _lrs(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in records if r.get("kind", "train") == "train" and "lr" in r]


@pytest.mark.parametrize("form", ["instance", "function"])
def test_an_optimizer_given_trains_bit_for_bit_as_the_same_one_configured(tmp_path: Path, form: str) -> None:
    """AdamW at lr 1e-2 (no decay) given to fit() is optim.name=adamw at optim.lr=1e-2: the same weights, bitwise (the same
    fused kernel on the same numbers), scaletrain's cosine schedule scaling the given lr as its own."""
    configured = Net()
    scaletrain.fit(configured, _data(), config={**QUICK, "run.dir": str(tmp_path / "cfg")})
    given = Net()
    opt = (torch.optim.AdamW(given.parameters(), lr=1e-2, weight_decay=0.0, fused=True) if form == "instance"
           else lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, fused=True))
    scaletrain.fit(given, _data(), config={**QUICK, "run.dir": str(tmp_path / "own")}, optimizer=opt)
    assert all(torch.equal(a, b) for a, b in zip(_weights(configured), _weights(given)))
    assert _lrs(tmp_path / "own") == _lrs(tmp_path / "cfg")
    assert not torch.equal(_weights(Net())[0], _weights(given)[0])  # it trained


def test_each_group_keeps_its_own_lr_under_the_schedule_and_the_linear_rule(tmp_path: Path) -> None:
    """Two groups at 1e-2 and 1e-3, a constant schedule with the linear scaling rule at global batch 64 over a
    base of 32: every step runs at 2e-2 and 2e-3."""
    model = Net()
    opt = torch.optim.SGD([{"params": model.inp.parameters(), "lr": 1e-3},
                           {"params": [p for n, p in model.named_parameters() if not n.startswith("inp.")]}],
                          lr=1e-2, momentum=0.9)
    scaletrain.fit(model, _data(), optimizer=opt, config={
        **QUICK, "run.dir": str(tmp_path / "r"), "train.global_batch": 64, "optim.scale_lr": True,
        "optim.base_batch": 32, "schedule.decay": "constant"})
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-3, 2e-2], rel=1e-12)
    assert _lrs(tmp_path / "r") == pytest.approx([2e-3] * 12, rel=1e-12)  # the first group's, logged


@pytest.mark.parametrize("form", ["instance", "function"])
def test_a_scheduler_given_drives_the_lr_and_resumes_bit_for_bit(tmp_path: Path, form: str) -> None:
    """StepLR halving every 5 steps: the logged lr is its sequence; a run stopped at step 7 and run again ends
    on the same weights as one that was not stopped."""
    def fit(run_dir: Path, **extra: object) -> nn.Module:
        model = Net()
        if form == "instance":
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            kwargs = {"optimizer": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)}
        else:
            kwargs = {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                      "scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)}
        with pytest.raises(Stopped) if "chaos.interrupt_step" in extra else contextlib.nullcontext():
            scaletrain.fit(model, _data(), config={**QUICK, "run.dir": str(run_dir), **extra}, **kwargs)
        return model

    whole = fit(tmp_path / "whole")
    assert _lrs(tmp_path / "whole") == pytest.approx([0.1 * 0.5 ** (step // 5) for step in range(1, 25)])
    fit(tmp_path / "cut", **{"chaos.interrupt_step": 7})
    resumed = fit(tmp_path / "cut")
    assert all(torch.equal(a, b) for a, b in zip(_weights(whole), _weights(resumed)))
    assert _lrs(tmp_path / "cut") == _lrs(tmp_path / "whole")[:7] + _lrs(tmp_path / "whole")[7:]


def test_a_scheduler_built_but_not_given_is_not_said_to_be_checkpointed(tmp_path: Path, capsys) -> None:
    """fit() steps the schedules it is given or configures; one the script built on the optimizer and kept
    (fit never steps it) was said to be "checkpointed with the run ... a resume goes on from its state", as a
    loop's own would be (the heap scan that finds those is for loops of one's own)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = torch.optim.lr_scheduler.StepLR(opt, 5)
    scaletrain.fit(model, _data(), optimizer=opt, config={**QUICK, "run.dir": str(tmp_path / "r"), "train.max_steps": 3})
    said = capsys.readouterr()
    assert "checkpointed with the run" not in said.out + said.err
    assert kept.last_epoch == 0  # never stepped: fit's own schedule set the lr


def _sharded(rank: int, world: int, run_dir: str, strategy: str) -> tuple[list[torch.Tensor], bool]:
    """nanoGPT's configure_optimizers and a OneCycleLR, built on the model before fit() shards it. fit() starts
    the process group; under FSDP it leaves it open for the sharded model the script holds, which can then
    be gathered whole (full_tensor() found no group by its name before) and run."""
    model = Net()
    opt = model.configure_optimizers(0.1, 3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=16)
    scaletrain.fit(model, _data(), optimizer=opt, scheduler=sched, config={
        **QUICK, "run.dir": run_dir, "data.batch_size": 32 // world, "train.global_batch": 32,
        "train.max_steps": 16, "parallel.strategy": strategy})
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in _weights(model)]
    if strategy == "fsdp":
        assert model(_data()[0][:4]).shape == (4, 2)
    return weights, dist.is_initialized()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_optimizer_built_before_sharding_trains_as_on_one_process(tmp_path: Path, strategy: str) -> None:
    """Under FSDP the optimizer built on the whole model is handed the shards; two ranks end within 1e-6 of
    one process (float sums in another order), weight decay and the schedule included."""
    one, _ = _sharded(0, 1, str(tmp_path / "one"), "ddp")
    per_rank = run_ranks(_sharded, 2, str(tmp_path / strategy), strategy)
    assert not torch.equal(one[0], Net().inp.weight)  # it trained
    for a, b in zip(one, per_rank[0][0]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert [r[1] for r in per_rank] == [strategy == "fsdp"] * 2  # the group left open for a sharded model only
    assert _lrs(tmp_path / strategy) == pytest.approx(_lrs(tmp_path / "one"), rel=1e-12)


@pytest.mark.parametrize("mistake, said", [
    ("built before the model", (r"fit\(optimizer=...\): the optimizer was built before fit\(\) built the model "
                                r"\(given as its class\).*fix: optimizer=lambda params: torch.optim.SGD\(params")),
    ("another model's", r"fit\(optimizer=...\): the optimizer holds parameters that are not the model's; fix:"),
    ("a name", r"fit\(optimizer=...\): a str is neither a torch optimizer nor a function of the parameters"),
    ("a function of nothing", r"fit\(optimizer=...\): the function given returned a NoneType, not a torch optimizer"),
    ("stepped", r"fit\(optimizer=...\): the optimizer has taken steps already; fix: give fit\(\) a new one"),
    ("plateau", r"fit\(scheduler=...\): ReduceLROnPlateau steps on a metric, which fit\(\) does not pass it"),
    ("another optimizer's", (r"fit\(scheduler=...\): the scheduler drives another optimizer than the one fit\(\) "
                             r"trains with")),
    ("scaled twice", (r"optim.scale_lr = true: the linear scaling rule scales the lr of scaletrain's schedule, and "
                      r"fit\(\) was given a scheduler of its own; fix: --optim.scale_lr=false")),
])
def test_mistakes_with_an_optimizer_or_a_scheduler_are_one_line(tmp_path: Path, mistake: str, said: str) -> None:
    model, other, config = Net(), Net(), {**QUICK, "run.dir": str(tmp_path / "r"), "train.max_steps": 2}
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kwargs: dict = {"optimizer": sgd}
    if mistake == "built before the model":
        kwargs, model = {"optimizer": sgd(model.parameters())}, Net
    elif mistake == "another model's":
        kwargs = {"optimizer": sgd(other.parameters())}
    elif mistake == "a name":
        kwargs = {"optimizer": "adamw"}
    elif mistake == "a function of nothing":
        kwargs = {"optimizer": lambda params: None}
    elif mistake == "stepped":
        opt = sgd(model.parameters())
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        kwargs = {"optimizer": opt}
    elif mistake == "plateau":
        kwargs["scheduler"] = torch.optim.lr_scheduler.ReduceLROnPlateau
    elif mistake == "another optimizer's":
        kwargs["scheduler"] = torch.optim.lr_scheduler.StepLR(sgd(other.parameters()), 5)
    elif mistake == "scaled twice":
        kwargs["scheduler"], config["optim.scale_lr"] = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5)), True
    with pytest.raises(UserError, match=said) as err:
        scaletrain.fit(model, _data(), config=config, **kwargs)
    assert "\n" not in str(err.value)


def test_a_resume_with_another_optimizer_names_both(tmp_path: Path) -> None:
    """A checkpoint of SGD's state resumed with AdamW: refused before AdamW reads SGD's momentum as its own."""
    config = {**QUICK, "run.dir": str(tmp_path / "r")}
    with pytest.raises(Stopped):
        scaletrain.fit(Net(), _data(), config={**config, "chaos.interrupt_step": 3},
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"the optimizer state is SGD's, this run uses AdamW; fix: resume"):
        scaletrain.fit(Net(), _data(), config=config, optimizer=lambda params: torch.optim.AdamW(params, lr=0.1))


def test_a_resume_with_another_kind_of_schedule_names_both(tmp_path: Path) -> None:
    config = {**QUICK, "run.dir": str(tmp_path / "r"), "chaos.interrupt_step": 3}
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)
    with pytest.raises(Stopped):
        scaletrain.fit(Net(), _data(), config=config, optimizer=sgd)
    config.pop("chaos.interrupt_step")
    with pytest.raises(CheckpointError, match=r"its LR schedule is scaletrain's \(schedule.\*\), this run's is the "
                                              r"scheduler given to fit\(\); fix: resume with the schedule it was made"):
        scaletrain.fit(Net(), _data(), config=config, optimizer=sgd,
                       scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5))


LOOP = """
import sys, torch, scaletrain
from torch import nn
with scaletrain.session({"train.max_steps": 6, "train.progress": False}, argv=sys.argv[2:]) as st:
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "adam": lambda ps: torch.optim.Adam(ps)}
    model, opt = st.setup(nn.Linear(4, 1), make[sys.argv[1]])
    while not st.done:
        with st.step():
            st.backward(model(torch.randn(8, 4)).pow(2).mean())
            opt.step()
            opt.zero_grad()
"""


def test_a_loop_resumed_with_another_optimizer_is_one_line(tmp_path: Path) -> None:
    """A session's checkpoint of SGD's state, set up again with Adam: one line and exit 2 (it was Adam's
    KeyError 'step' from inside torch, a traceback), and nothing of the checkpoint lost."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    run = [*PYTHON, str(script)]
    where = f"--run.dir={tmp_path / 'r'}"
    stopped = subprocess.run([*run, "sgd", where, "--chaos.interrupt_step=3"], capture_output=True, text=True, check=False)
    assert "checkpoint" in stopped.stdout + stopped.stderr, stopped.stderr
    other = subprocess.run([*run, "adam", where], capture_output=True, text=True, check=False)
    assert other.returncode == 2, other.stderr
    assert other.stderr.strip().splitlines()[-1] == (
        f"scaletrain: error: checkpoint {tmp_path / 'r' / 'checkpoints' / 'step-00000003'}: the optimizer state of "
        "'model0' is SGD's, this run sets up Adam; fix: set up the optimizers the checkpoint was made with (the state "
        "of one is not another's), or start a new --run.dir")
    assert "Traceback" not in other.stderr
    same = subprocess.run([*run, "sgd", where], capture_output=True, text=True, check=False)
    assert same.returncode == 0, same.stderr
    assert "resumed from" in same.stdout + same.stderr
