"""The same model trained twice in one process (fit() then fit() again with other settings or data, as
Lightning's trainer.fit twice; a session after fit()): under FSDP the model comes back sharded, and fully_shard
again was an AssertionError traceback before step one; with activation checkpointing each block was
checkpointed inside its own checkpoint (recomputed twice) and stayed checkpointed under
memory.activation_checkpointing=none."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from spawn_ranks import run_ranks
from test_fit_optimizer import Net  # repeated blocks: FSDP units, each checkpointed
from torch import nn

import scaletrain
from scaletrain.errors import UserError
from scaletrain.parallel import apply_activation_checkpointing

QUICK = {"train.epochs": 1, "data.batch_size": 16, "optim.lr": 1e-2, "train.progress": False}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] - x[:, 2] > 0).long()


def _evals(run_dir: str) -> list[float]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in records if r.get("kind") == "eval"]


def _twice(rank: int, world: int, run_dir: str, strategy: str) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """fit() twice on one model, checkpointing its blocks: once as the first run, then on with a lower lr."""
    model, data = Net(), _data()
    config = {**QUICK, "parallel.strategy": strategy, "memory.activation_checkpointing": "full"}
    scaletrain.fit(model, data, eval_data=data, config={**config, "run.dir": f"{run_dir}/first"})
    scaletrain.fit(model, data, eval_data=data, config={**config, "run.dir": f"{run_dir}/again", "optim.lr": 3e-3})
    weights = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    return _evals(f"{run_dir}/first"), _evals(f"{run_dir}/again"), weights


def test_a_model_fit_twice_trains_on_under_ddp_and_fsdp_alike(tmp_path: Path) -> None:
    """The second fit() starts from the weights the first ended with (its step-0 evaluation is the first's
    last, bit for bit) and trains on; under FSDP, its sharding kept, as under DDP within 1e-6."""
    ran = {s: run_ranks(_twice, 2, str(tmp_path / s), s)[0] for s in ("ddp", "fsdp")}
    for first, again, _ in ran.values():
        assert len(first) == len(again) == 2
        assert again[0] == first[-1]  # the same model, evaluated on the same data
        assert again[-1] < again[0]  # and trained on
    for a, b in zip(ran["ddp"][2], ran["fsdp"][2]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def _mistakes(rank: int, world: int, run_dir: str) -> list[str]:
    """What fit() says of a model sharded before, asked to train it another way, or inside a new model."""
    model, data, said = Net(), _data(), []
    config = {**QUICK, "parallel.strategy": "fsdp", "train.max_steps": 2}
    scaletrain.fit(model, data, config={**config, "run.dir": f"{run_dir}/first"})
    for change, which in [({"parallel.reshard_after_forward": False}, model),
                          ({"parallel.strategy": "ddp"}, model),
                          ({}, nn.Sequential(model.inp, model.blocks[0], model.out))]:
        try:
            scaletrain.fit(which, data, config={**config, **change, "run.dir": f"{run_dir}/{len(said)}"})
        except UserError as err:
            said.append(str(err))
    return said


def test_a_model_sharded_before_and_asked_for_another_sharding_is_one_line(tmp_path: Path) -> None:
    said = run_ranks(_mistakes, 2, str(tmp_path))[0]
    assert said == [
        ("parallel.reshard_after_forward = False: expected True, as the model was sharded by an earlier run in "
         "this process (FSDP shards a module once); fix: --parallel.reshard_after_forward=true, or a model built "
         "anew"),
        ("parallel.strategy = 'ddp': expected fsdp: the model is sharded by FSDP already (an earlier fit() or "
         "session in this process, or the script's own fully_shard); fix: --parallel.strategy=fsdp, which keeps "
         "its sharding, or a model built anew"),
        ("model: its submodule '1' is sharded by FSDP already (an earlier fit() or session in this process, or "
         "the script's own fully_shard) and the model holding it is not; FSDP shards a module once, and runs "
         "its sharded parts from the model they were sharded in; fix: give the whole model that was sharded, or "
         "build this one of modules not sharded (an earlier run's whole weights are in RUN_DIR/model.safetensors)"),
    ]


def test_checkpointing_a_block_again_replaces_its_checkpoint() -> None:
    """Each block's forward is checkpointed once however often a run checkpoints the model, and given back
    whole under mode none (the model trains after it as if never checkpointed)."""
    model = Net()
    originals = [block.forward for block in model.blocks]
    for mode in ("full", "selective", "full"):
        apply_activation_checkpointing(model, mode)
        assert [block.forward.__wrapped__ for block in model.blocks] == originals
    apply_activation_checkpointing(model, "none")
    assert all("forward" not in block.__dict__ for block in model.blocks)
    assert [block.forward for block in model.blocks] == originals
