"""The loader resumes mid-epoch exactly, with worker processes, on every rank; a changed global batch on
resume is kept through accumulation when it can be, and stated when it cannot."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from scaletrain.config import load
from scaletrain.data import ShardedLoader, TensorPairs
from scaletrain.train.batching import plan_batches


def _data(n: int = 301) -> TensorPairs:
    return TensorPairs(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


@pytest.mark.parametrize("rank", [0, 1])
def test_mid_epoch_resume_with_two_workers_gives_the_same_next_batches(rank):
    def loader() -> ShardedLoader:
        return ShardedLoader(_data(), batch_size=4, rank=rank, world=2, accum=2, seed=3, num_workers=2)

    straight = loader()
    it = iter(straight)
    for _ in range(13):  # mid-epoch: 301 // 16 = 18 steps = 36 micro-batches per rank per epoch
        next(it)
    state = straight.state_dict()
    want = [next(it) for _ in range(8)]
    resumed = loader()
    resumed.load_state_dict(state)
    got = list(itertools.islice(iter(resumed), 8))
    for (xa, ya), (xb, yb) in zip(want, got):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert state["cursor"] == 13 * 8 and state["epoch"] == 0


class _CollectingInWorkers(TensorPairs):
    """Runs the cycle collector in the worker process at every sample, as a worker's allocations may."""

    def __getitem__(self, i: int):
        gc.collect()
        return super().__getitem__(i)


def test_garbage_that_owns_a_thread_is_not_finalized_in_the_forked_workers():
    """A TCPStore server (a thread and a socket) dropped in a reference cycle waits for the collector; a worker
    forked before it ran inherited it and crashed finalizing it (segfault: "DataLoader worker exited
    unexpectedly", seen in the suite as a worker's abort). The loader collects before it forks."""
    from torch.distributed import TCPStore

    class Holder:
        pass

    was = gc.isenabled()
    gc.disable()  # the cycle stays until someone collects
    try:
        for _ in range(4):  # one crashed the workers in some runs, four in every one tried
            held = Holder()
            held.me, held.store = held, TCPStore("127.0.0.1", 0, 1, True)
            del held
        data = _CollectingInWorkers(torch.arange(64, dtype=torch.float32).unsqueeze(1), torch.arange(64))
        loader = ShardedLoader(data, batch_size=4, rank=0, world=1, accum=1, seed=0, num_workers=2)
        got = [y for _, y in itertools.islice(iter(loader), 4)]
    finally:
        if was:
            gc.enable()
    seen = torch.cat(got).tolist()
    assert len(seen) == len(set(seen)) == 16  # 4 batches of 4 distinct samples, from live workers


def _resume_meta(world: int, global_batch: int) -> dict:
    return {"world_size": world, "global_batch": global_batch, "step": 10,
            "loader": {"epoch": 0, "cursor": 640, "end": 1408, "size": 1437, "step_samples": global_batch}}


def test_resume_at_another_world_size_keeps_the_global_batch_or_says_why_not():
    cfg = load("digits", {"data.batch_size": 32})
    kept = plan_batches(cfg, 1, 1437, _resume_meta(2, 64))
    assert kept.global_batch == 64 and kept.accum_steps == 2
    assert kept.note == "world size 2 -> 1: accumulation 2 keeps the global batch at 64"
    assert kept.total_steps == cfg.train.epochs * 22  # 10 done + 12 left in the epoch + 19 whole epochs

    cfg48 = load("digits", {"data.batch_size": 48})
    changed = plan_batches(cfg48, 1, 1437, _resume_meta(2, 64))
    assert changed.global_batch == 48
    assert changed.note == ("world size 2 -> 1: the global batch changes 64 -> 48 (64 is not a multiple of "
                            "batch_size x world = 48); --data.batch_size=32 keeps it at 64 (accumulation 2)")
    # the rest of the interrupted epoch at the new step size, then whole epochs of 1437 // 48 = 29 steps
    assert changed.total_steps == 10 + (1437 - 640) // 48 + (cfg48.train.epochs - 1) * 29

    same = plan_batches(cfg, 2, 1437, _resume_meta(2, 64))
    assert same.note == "" and same.global_batch == 64
