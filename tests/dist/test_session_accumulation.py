"""A loop of one's own accumulating gradients over st.loader(..., accum=N): the micro-batches but the last of each
step keep their gradients local (DDP's no_sync, FSDP2's set_requires_gradient_sync), as the trainer does, so the
gradients cross the network once per optimizer step instead of N times; and a step that ends inside an
accumulation is one line, not an optimizer step on gradients that were never averaged.

Before, every micro-batch's backward all-reduced (the gradients were equal on both ranks after the first micro-
batch), and a loop drawing one batch per step from an accum=4 loader trained on as if nothing were wrong."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from spawn_ranks import run_ranks

ACCUM, BATCH = 4, 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


@contextlib.contextmanager
def _classifier(where: str, name: str, strategy: str, batch_size: int) -> Iterator[tuple[Any, Any, Any]]:
    """(session, model, optimizer): 5 steps of a small classifier under ``strategy``, SGD at lr 0.5, in run
    directory ``name``."""
    import scaletrain

    cfg = {"run.dir": str(Path(where) / name), "train.max_steps": 5, "data.batch_size": batch_size,
           "parallel.strategy": strategy, "train.progress": False, "log.every": 5}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                              lambda p: torch.optim.SGD(p, lr=0.5))
        yield st, model, opt


def _loop(rank: int, world: int, where: str, strategy: str, accum: int) -> list[bool]:
    """5 steps of a small classifier accumulating ``accum`` micro-batches of 16 / accum; per micro-batch, whether
    this rank's gradient equalled the other rank's right after its backward (a synchronized one does)."""
    import torch.distributed as dist

    same: list[bool] = []
    with _classifier(where, f"{strategy}-{accum}", strategy, 16 // accum) as (st, model, opt):
        batches = iter(st.loader(_data(), accum=accum, shuffle=False))
        while not st.done:
            with st.step():
                for _ in range(accum):
                    x, y = next(batches)
                    st.backward(torch.nn.functional.cross_entropy(model(x), y) / accum)
                    if strategy == "ddp" and world > 1:  # FSDP keeps an unsynced micro-batch's gradient inside, unsharded
                        mine = model.module[0].weight.grad.clone()
                        theirs = [torch.zeros_like(mine) for _ in range(world)]
                        dist.all_gather(theirs, mine)
                        same.append(torch.equal(theirs[0], theirs[1]))
                opt.step()
                opt.zero_grad()
    return same


def _runs(rank: int, world: int, where: str, strategy: str) -> dict[int, list[bool]]:
    return {accum: _loop(rank, world, where, strategy, accum) for accum in (1, ACCUM)}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_micro_batches_but_the_last_keep_their_gradients_local_and_train_as_one_batch(tmp_path, strategy):
    per_rank = run_ranks(_runs, 2, str(tmp_path), strategy)
    if strategy == "ddp":
        # one batch of 16: synchronized at every backward; 4 of 4: only at each step's last
        assert per_rank[0][1] == [True] * 5
        assert per_rank[0][ACCUM] == [False, False, False, True] * 5
    weights = [safetensors.torch.load_file(str(tmp_path / f"{strategy}-{a}" / "model.safetensors")) for a in (1, ACCUM)]
    for k, w in weights[0].items():  # the same 16 samples per rank per step: the same step, to rounding
        torch.testing.assert_close(weights[1][k], w, rtol=0, atol=1e-6)


def _one_per_step(rank: int, world: int, where: str) -> None:
    import scaletrain

    cfg = {"run.dir": str(Path(where) / "misused"), "train.max_steps": 5, "data.batch_size": BATCH,
           "train.progress": False, "checkpoint.every": 1}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(torch.nn.Linear(6, 2), lambda p: torch.optim.SGD(p, lr=0.5))
        for x, y in st.loader(_data(), accum=ACCUM):
            with st.step():
                st.backward(torch.nn.functional.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_that_ends_inside_an_accumulation_is_one_line(tmp_path, world):
    """Drawing one batch per step from an accum=4 loader: at any world size the same line at step 1, before a
    checkpoint could keep a position inside a step."""
    from scaletrain.errors import UserError

    if world == 1:
        with pytest.raises(UserError) as err:
            _one_per_step(0, 1, str(tmp_path))
        said = str(err.value)
    else:
        with pytest.raises(Exception, match="UserError") as err:
            run_ranks(_one_per_step, 2, str(tmp_path))
        said = str(err.value)
    assert ("session.loader(accum=4) hands 4 micro-batches to each optimizer step, and step 1 ended after 1 "
            "(gradients are averaged over the ranks at a step's last micro-batch); fix: draw all 4 inside one "
            "`with st.step():`, a forward and backward each, or accum=1 for a step per batch") in said
    assert not (tmp_path / "misused" / "checkpoints").exists() or not any((tmp_path / "misused" / "checkpoints").iterdir())


def _own_accumulation(rank: int, world: int, where: str, strategy: str, idiom: str) -> list[bool]:
    """The loop accumulating by itself, as a DDP script does, from a loader of micro-batches (accum 1): DDP's
    ``with model.no_sync():`` or nanoGPT's ``model.require_backward_grad_sync = last``; per micro-batch, whether
    its gradient stayed off the parameters (under FSDP an unsynced one is kept inside, unsharded)."""
    local: list[bool] = []
    with _classifier(where, f"own-{idiom}", strategy, 16 // ACCUM) as (st, model, opt):
        batches = iter(st.loader(_data(), shuffle=False))
        while not st.done:
            with st.step():
                for i in range(ACCUM):
                    x, y = next(batches)
                    last = i == ACCUM - 1
                    if idiom == "no_sync":
                        switch = contextlib.nullcontext() if last else model.no_sync()
                    else:
                        model.require_backward_grad_sync = last
                        switch = contextlib.nullcontext()
                    with switch:
                        st.backward(torch.nn.functional.cross_entropy(model(x), y) / ACCUM)
                    local.append(all(p.grad is None for p in model.parameters()))
                opt.step()
                opt.zero_grad()
    return local


def _both_idioms(rank: int, world: int, where: str, strategy: str) -> dict[str, list[bool]]:
    return {"reference": _loop(rank, world, where, strategy, 1),
            **{idiom: _own_accumulation(rank, world, where, strategy, idiom) for idiom in ("no_sync", "flag")}}


@pytest.mark.parametrize(("world", "strategy"), [(1, "ddp"), (2, "fsdp")])
def test_a_ddp_loops_own_accumulation_runs_under_fsdp_and_on_one_process(tmp_path, world, strategy):
    """A DDP script's accumulation (model.no_sync(), or nanoGPT's model.require_backward_grad_sync) run with
    --parallel.strategy=fsdp, or as one process, stopped at its first micro-batch: "'FSDPSequential' object has
    no attribute 'no_sync'" ('Sequential' on one process). Both now switch the gradient sync as under DDP: on 2
    ranks the micro-batches but each step's last keep their gradients local (none reaches the sharded parameters)
    and the steps equal one batch of 16's to rounding; on one process both are the plain loop."""
    per_rank = run_ranks(_both_idioms, world, str(tmp_path), strategy)
    reference = safetensors.torch.load_file(str(tmp_path / f"{strategy}-1" / "model.safetensors"))
    for idiom in ("no_sync", "flag"):
        assert per_rank[0][idiom] == ([True, True, True, False] if world == 2 else [False] * 4) * 5, idiom
        own = safetensors.torch.load_file(str(tmp_path / f"own-{idiom}" / "model.safetensors"))
        for k, w in reference.items():
            torch.testing.assert_close(own[k], w, rtol=0, atol=1e-6)
