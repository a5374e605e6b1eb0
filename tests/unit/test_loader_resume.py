"""The loader resumes mid-epoch exactly, with worker processes, on every rank; a changed global batch on
resume is kept through accumulation when it can be, and stated when it cannot."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from scaletrain.config import load
from scaletrain.data import ShardedLoader, TensorPairs, Weighted, in_memory
from scaletrain.errors import UserError
from scaletrain.train.batching import plan_batches


def _data(n: int = 301) -> TensorPairs:
    return TensorPairs(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def _stopped(loader: ShardedLoader, after: int, n: int) -> tuple[dict[str, int], list]:
    """``loader`` read ``after`` micro-batches: its state then, and the ``n`` it gives next."""
    it = iter(loader)
    for _ in range(after):
        next(it)
    state = loader.state_dict()
    return state, [next(it) for _ in range(n)]


def _resumed(loader: ShardedLoader, state: dict[str, int], n: int) -> list:
    """The first ``n`` micro-batches of a new ``loader`` resumed from ``state``."""
    loader.load_state_dict(state)
    return list(itertools.islice(iter(loader), n))


@pytest.mark.parametrize("rank", [0, 1])
def test_mid_epoch_resume_with_two_workers_gives_the_same_next_batches(rank):
    def loader() -> ShardedLoader:
        return ShardedLoader(_data(), batch_size=4, rank=rank, world=2, accum=2, seed=3, num_workers=2)

    # mid-epoch: 301 // 16 = 18 steps = 36 micro-batches per rank per epoch
    state, want = _stopped(loader(), 13, 8)
    got = _resumed(loader(), state, 8)
    for (xa, ya), (xb, yb) in zip(want, got):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert state["cursor"] == 13 * 8 and state["epoch"] == 0


class _Augmented(torch.utils.data.Dataset):
    """Each sample drawn anew from the global RNGs of whoever reads it, as a random crop or flip does: torch's
    noise, Python's coin, NumPy's jitter."""

    def __len__(self) -> int:
        return 301

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import random

        import numpy as np

        coin = 1.0 if random.random() < 0.5 else -1.0
        return torch.randn(3) * coin + float(np.random.uniform()), i


def test_samples_augmented_in_workers_resume_exactly_whatever_the_workers():
    """In workers, a sample's random draws depend on its epoch and index only: a loader resumed mid-epoch (its
    new iterator restarts the workers' RNGs) gives the straight run's augmented samples, with 2 workers or 1.
    Before, each worker's RNG was seeded once as the iterator started: the resumed batches were augmented
    otherwise (verify-resume: 'data ... differ')."""

    def loader(workers: int) -> ShardedLoader:
        return ShardedLoader(_Augmented(), batch_size=4, rank=1, world=2, accum=1, seed=3, num_workers=workers)

    straight = loader(2)
    state, want = _stopped(straight, 33, 8)  # 37 steps an epoch: into the next epoch after the resume
    for workers in (2, 1):
        got = _resumed(loader(workers), state, 8)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))
    assert state["epoch"] == 0 and straight.epoch == 1  # resumed in epoch 0, on into epoch 1
    assert len({float(x.sum()) for x, _ in want}) == 8  # drawn anew, not one draw repeated


class _BatchedAugmented(_Augmented):
    """A data set with a batched fetch of its own (as Hugging Face datasets read an Arrow slice per batch), each
    sample augmented from the global RNGs."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        return [(self[i][0], -i) for i in indices]  # -i: told apart from a per-sample read


def test_a_data_sets_own_batched_fetch_is_kept_in_workers_and_resumes_exactly():
    """Its __getitems__ still reads each batch (negative targets: not one read per sample), the RNGs seeded per
    batch from its first key: a loader resumed mid-epoch gives the straight run's augmented batches."""

    def loader() -> ShardedLoader:
        return ShardedLoader(_BatchedAugmented(), batch_size=4, rank=0, world=2, accum=1, seed=3, num_workers=2)

    state, want = _stopped(loader(), 5, 4)
    got = _resumed(loader(), state, 4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))
    assert all((y <= 0).all() for _, y in want) and len({float(x.sum()) for x, _ in want}) == 4


def _weighted(n: int = 200, draws: int = 210) -> Weighted:
    """n samples whose target is their index, the first 20 weighed 9: about half of the draws."""
    return Weighted(_data(n), torch.where(torch.arange(n) < 20, 9.0, 1.0), draws)


def test_weighted_epochs_are_drawn_by_weight_sharded_by_position_and_resumed_exactly():
    """An epoch is the weighted set's draws (torch.multinomial from seed + epoch): 210 draws in steps of 2 ranks
    x 5 x accumulation 2 are 10 steps, rank r takes positions r, r + 2, ... of them, as of a permutation; every
    epoch draws anew; mid-epoch resume gives the same next batches, and so does one at world size 1."""
    data = _weighted()
    loaders = [ShardedLoader(data, batch_size=5, rank=r, world=2, accum=2, seed=3) for r in (0, 1)]
    assert all(lo.steps_per_epoch == 10 for lo in loaders)
    epochs = []
    for epoch in range(3):
        got = [torch.cat([y for _, y in itertools.islice(iter(lo), 20)]) for lo in loaders]
        order = data.order(3, epoch)[:200]
        assert [g.tolist() for g in got] == [order[r::2].tolist() for r in (0, 1)]
        epochs.append(order)
    assert not torch.equal(epochs[0], epochs[1])
    rare = sum(int((e < 20).sum()) for e in epochs) / 600
    assert 0.4 < rare < 0.6, rare  # 20 x 9 of 180 + 180 weight: half, where 10% are rare

    straight = ShardedLoader(data, batch_size=5, rank=1, world=2, accum=2, seed=3)
    it = iter(straight)
    for _ in range(8):  # 4 steps of 2 micro-batches: 80 positions
        next(it)
    state = straight.state_dict()
    want = [next(it)[1] for _ in range(6)]
    again = ShardedLoader(data, batch_size=5, rank=1, world=2, accum=2, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a, b[1]) for a, b in zip(want, itertools.islice(iter(again), 6)))
    alone = ShardedLoader(data, batch_size=10, rank=0, world=1, accum=2, seed=3)  # world 1: both ranks' positions
    alone.load_state_dict({**state, "step_samples": 20})
    assert state["cursor"] == 80 and torch.equal(next(iter(alone))[1], data.order(3, 0)[80:90])


def test_a_weighted_set_holds_out_its_samples_unweighted_and_bad_weights_are_one_line():
    splits = in_memory(_weighted(), val_fraction=0.2)
    assert isinstance(splits.train, Weighted) and len(splits.train) == 160 and splits.train.num_samples == 168
    assert not isinstance(splits.eval, Weighted) and len(splits.eval) == 40  # each held-out sample once
    held = {int(splits.eval[i][1]) for i in range(40)}
    kept = {int(splits.train[i][1]) for i in range(160)}
    assert not held & kept and len(held | kept) == 200
    assert all(splits.train.weights[i] == (9.0 if int(splits.train[i][1]) < 20 else 1.0) for i in range(160))
    for weights, draws, replacement, said in [(torch.ones(5), 10, True, "5 weights for 200 samples"),
                                              (-torch.ones(200), 10, True, "a negative or non-finite weight"),
                                              (torch.zeros(200), 10, True, "no positive weight"),
                                              (torch.ones(200), 300, False, "300 samples drawn without replacement")]:
        with pytest.raises(UserError, match=f"^data: weighted sampling with {said}.*; fix: WeightedRandomSampler"):
            Weighted(_data(200), weights, draws, replacement)


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
