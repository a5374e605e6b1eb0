"""The sharded, resumable training loader: DistributedSampler's order, the tail rule, exact resume.

Every test feeds the loader a data set whose sample i is the integer i, so a batch shows exactly which
permutation positions it holds. Sizes are chosen not to divide the step size, so the dropped tail is real.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from scaletrain.data import ShardedLoader, ShardedSampler, epoch_permutation
from scaletrain.errors import UserError

SIZE = 103  # prime: no world size, batch or accumulation below divides it
BATCH = 4
SEED = 1234


class Indices(Dataset):
    """Sample i is i (module level, so DataLoader workers can unpickle it)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        return i


def make(world: int, rank: int, *, size: int = SIZE, batch: int = BATCH, accum: int = 1, seed: int = SEED,
         shuffle: bool = True, num_workers: int = 0) -> ShardedLoader:
    return ShardedLoader(Indices(size), batch_size=batch, rank=rank, world=world, accum=accum, seed=seed,
                         shuffle=shuffle, num_workers=num_workers)


def take(it, n: int) -> list[list[int]]:
    """The next n micro-batches of an iterator, as lists of sample indices."""
    return [b.tolist() for b in itertools.islice(it, n)]


def rest_of_epoch(loader: ShardedLoader, it) -> tuple[list[list[int]], list[int]]:
    """Micro-batches until the loader moves to the next epoch; also returns the next epoch's first batch."""
    epoch, batches = loader.epoch, []
    for batch in it:
        if loader.epoch != epoch:
            return batches, batch.tolist()
        batches.append(batch.tolist())
    raise AssertionError("the loader stopped")  # it never does: it runs epoch after epoch


def interleave(per_rank: list[list[list[int]]]) -> list[int]:
    """The global order of samples: micro-step k of rank r holds positions k*b*W + r + W*j, j < b."""
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, f"ranks ran different numbers of micro-steps: {steps}"
    order = []
    for step in zip(*per_rank):  # step[r] = rank r's micro-batch
        order += [i for column in zip(*step) for i in column]
    return order


def one_epoch(world: int, **kw) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        loader = make(world, rank, **kw)
        batches, _ = rest_of_epoch(loader, iter(loader))
        out.append(batches)
    return out


# --- sharding and the tail rule --------------------------------------------------------------------------


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_one_epoch_is_the_permutation_minus_the_tail(world: int, accum: int) -> None:
    step = BATCH * world * accum
    tail = SIZE % step
    assert tail > 0  # the case under test
    per_rank = one_epoch(world, accum=accum)
    loader = make(world, 0, accum=accum)
    assert loader.step_samples == step
    assert loader.steps_per_epoch == SIZE // step
    for batches in per_rank:
        assert len(batches) == loader.steps_per_epoch * accum  # whole optimizer steps, same on every rank
        assert all(len(b) == BATCH for b in batches)
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert max(seen.values()) == 1  # no sample on two ranks, nor twice on one
    assert len(seen) == SIZE - tail
    perm = epoch_permutation(SIZE, SEED, 0, True).tolist()
    assert set(seen) == set(perm[: SIZE - tail])
    assert set(perm[SIZE - tail :]).isdisjoint(seen)  # exactly the documented tail is dropped
    assert interleave(per_rank) == perm[: SIZE - tail]


def test_sampler_alone_shards_without_overlap() -> None:
    usable = 96  # any multiple of the world size
    shards = [list(ShardedSampler(SIZE, rank=r, world=3, seed=SEED, shuffle=True, usable=usable)) for r in range(3)]
    assert [len(s) for s in shards] == [32, 32, 32]
    assert [len(ShardedSampler(SIZE, rank=r, world=3, seed=SEED, shuffle=True, usable=usable)) for r in range(3)] \
        == [32, 32, 32]
    perm = epoch_permutation(SIZE, SEED, 0, True).tolist()
    assert sorted(i for s in shards for i in s) == sorted(perm[:usable])
    assert shards[1] == perm[1:usable:3]


def test_without_shuffle_the_order_is_the_index_order() -> None:
    per_rank = one_epoch(2, shuffle=False)
    assert interleave(per_rank) == list(range(96))
    assert per_rank[1][0] == [1, 3, 5, 7]


# --- order across epochs and seeds -----------------------------------------------------------------------


def epochs(seed: int, n: int, world: int = 1) -> list[list[int]]:
    loader = make(world, 0, seed=seed)
    it = iter(loader)
    out = []
    for _ in range(n):
        batches, first_of_next = rest_of_epoch(loader, it)
        out.append([i for b in batches for i in b])
        it = itertools.chain([torch.tensor(first_of_next)], it)
    return out


def test_order_changes_every_epoch_and_follows_the_seed() -> None:
    e0, e1, e2 = epochs(SEED, 3)
    assert len(e0) == len(e1) == len(e2) == 100  # 103 - 103 % 4
    assert e0 != e1 and e1 != e2 and e0 != e2
    assert set(e0) != set(e1)  # the dropped tail changes with the permutation
    for e, order in enumerate((e0, e1, e2)):
        assert order == torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED + e)).tolist()[:100]
    assert epochs(SEED, 3) == [e0, e1, e2]  # same seed, same order
    other = epochs(SEED + 7, 2)
    assert other[0] != e0 and other[1] != e1


def test_the_permutation_does_not_depend_on_the_world_size() -> None:
    orders = {w: interleave(one_epoch(w)) for w in (1, 2, 4)}
    assert [len(orders[w]) for w in (1, 2, 4)] == [100, 96, 96]
    perm = epoch_permutation(SIZE, SEED, 0, True).tolist()
    for w, order in orders.items():
        assert order == perm[: len(order)], w
    assert orders[2] == orders[4] == orders[1][:96]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_torch_distributed_sampler(world: int) -> None:
    size, seed = 96, 5  # 96 = 4 x 24 divides every step size here: no dropped tail
    assert size % (BATCH * world) == 0
    for rank in range(world):
        loader = make(world, rank, size=size, seed=seed)
        it = iter(loader)
        theirs = DistributedSampler(Indices(size), num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                    drop_last=True)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            batches, first_of_next = rest_of_epoch(loader, it)
            it = itertools.chain([torch.tensor(first_of_next)], it)
            assert [i for b in batches for i in b] == list(theirs), (rank, epoch)


# --- state_dict / load_state_dict ------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers, cuts", [(0, [0, 5, 12, 17, 24]), (2, [7, 12])])
def test_resume_gives_exactly_the_rest_of_the_uninterrupted_run(num_workers: int, cuts: list[int]) -> None:
    world, accum = 2, 2  # 16 samples per step, 6 steps (12 micro-batches) per epoch
    total = 30  # micro-batches: two and a half epochs
    for rank in range(world):
        whole = take(iter(make(world, rank, accum=accum)), total)
        for k in cuts:
            first = make(world, rank, accum=accum, num_workers=num_workers)
            head = take(iter(first), k)
            state = first.state_dict()
            # A batch counts as consumed once handed out; the epoch turns over when the next one is asked for.
            expected = (0, 0) if k == 0 else ((k - 1) // 12, ((k - 1) % 12 + 1) * BATCH * world)
            assert (state["epoch"], state["cursor"]) == expected
            del first
            fresh = make(world, rank, accum=accum, num_workers=num_workers)
            fresh.load_state_dict(dict(state))
            assert head + take(iter(fresh), total - k) == whole, (rank, k)
            del fresh


def test_state_after_the_last_batch_of_an_epoch_resumes_in_the_next() -> None:
    loader = make(1, 0)
    it = iter(loader)
    take(it, 25)  # all 25 micro-batches of epoch 0
    state = loader.state_dict()
    assert (state["epoch"], state["cursor"]) == (0, 100)
    fresh = make(1, 0)
    fresh.load_state_dict(state)
    nxt = take(iter(fresh), 1)
    assert fresh.epoch == 1
    assert nxt == take(it, 1) == [epoch_permutation(SIZE, SEED, 1, True).tolist()[:BATCH]]


def test_state_is_plain_ints() -> None:
    loader = make(2, 1)
    take(iter(loader), 3)
    state = loader.state_dict()
    assert all(type(v) is int for v in state.values())
    assert state["cursor"] == 3 * BATCH * 2


def test_state_of_another_data_set_size_is_refused() -> None:
    loader = make(1, 0)
    take(iter(loader), 2)
    other = make(1, 0, size=SIZE + 1)
    with pytest.raises(UserError, match=r"103 samples, but this one has 104"):
        other.load_state_dict(loader.state_dict())


# --- resume at another world size ------------------------------------------------------------------------


def run_then_resume(k_steps: int, world: int, new_world: int, accum: int = 1, new_accum: int = 1):
    """k optimizer steps at `world`, then the rest of the epoch (and the next one) at `new_world`."""
    before, states = [], []
    for rank in range(world):
        loader = make(world, rank, accum=accum)
        before.append(take(iter(loader), k_steps * accum))
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)  # the cursor is global: every rank saves the same state
    after, next_epoch = [], []
    for rank in range(new_world):
        loader = make(new_world, rank, accum=new_accum)
        loader.load_state_dict(states[0])
        it = iter(loader)
        batches, first = rest_of_epoch(loader, it)
        after.append(batches)
        more, _ = rest_of_epoch(loader, itertools.chain([torch.tensor(first)], it))
        next_epoch.append(more)
    return states[0], interleave(before), interleave(after), next_epoch


@pytest.mark.parametrize("world, new_world, k_steps, expected_end", [
    (2, 1, 5, 100),  # cursor 40 -> world 1 runs positions 40..99 (whole steps of 4; 3 dropped)
    (2, 3, 3, 96),   # cursor 24, a multiple of world 3's step of 12: the plain tail rule of world 3
    (2, 3, 5, 100),  # cursor 40 is not: the rest (63 positions) is cut into 5 steps of 12, 3 dropped
    (3, 2, 2, 96),   # cursor 24 -> 9 steps of 8
    (4, 3, 1, 100),  # cursor 16 -> 7 steps of 12
])
def test_resume_at_another_world_size_sees_every_sample_once(world: int, new_world: int, k_steps: int,
                                                             expected_end: int) -> None:
    state, before, after, next_epoch = run_then_resume(k_steps, world, new_world)
    cursor = k_steps * BATCH * world
    assert state["cursor"] == cursor == len(before)
    new_step = BATCH * new_world
    assert expected_end == cursor + (SIZE - cursor) // new_step * new_step
    perm = epoch_permutation(SIZE, SEED, 0, True).tolist()
    seen = before + after
    assert len(seen) == len(set(seen)) == expected_end  # once each, none skipped: a prefix of the permutation
    assert seen == perm[:expected_end]
    # The next epoch follows the new world's plain rule again.
    usable = SIZE // new_step * new_step
    assert interleave(next_epoch) == epoch_permutation(SIZE, SEED, 1, True).tolist()[:usable]


def test_resume_with_the_same_global_batch_keeps_the_epoch() -> None:
    """World 2 -> 1 with accumulation 1 -> 2 keeps 8 samples per step, so the tail is the same 7 samples."""
    _, before, after, _ = run_then_resume(5, 2, 1, accum=1, new_accum=2)
    assert before + after == epoch_permutation(SIZE, SEED, 0, True).tolist()[:96]


def test_a_resumed_epoch_resumes_again_at_its_own_world_size() -> None:
    """After 2 -> 3 from a cursor that is not a multiple of 12, saving and resuming at world 3 keeps the end."""
    states = []
    for rank in range(2):
        loader = make(2, rank)
        take(iter(loader), 5)
        states.append(loader.state_dict())
    whole, cut = [], []
    for rank in range(3):
        a = make(3, rank)
        a.load_state_dict(states[0])
        whole.append(rest_of_epoch(a, iter(a))[0])
        b = make(3, rank)
        b.load_state_dict(states[0])
        head = take(iter(b), 2)
        again = make(3, rank)
        again.load_state_dict(b.state_dict())
        cut.append(head + rest_of_epoch(again, iter(again))[0])
    assert cut == whole
    assert len(interleave(whole)) == 60  # positions 40..99


def test_a_state_with_only_epoch_and_cursor_still_loads() -> None:
    """The plain tail rule applies when the state does not say where its epoch ends."""
    whole = take(iter(make(2, 1)), 20)
    fresh = make(2, 1)
    fresh.load_state_dict({"epoch": 0, "cursor": 5 * BATCH * 2})
    assert take(iter(fresh), 15) == whole[5:]


def test_a_tensor_parallel_group_reads_one_batch_and_data_parallel_groups_split_the_epoch():
    """8 ranks as FSDP 4 x TP 2 (the trainer builds each rank's loader from Layout.dp_rank and dp_size): the 2
    ranks of a tensor-parallel group get the same batches, the 4 groups disjoint ones, and over an epoch the
    readers (Layout.reads: each group's first rank) see every usable position exactly once."""
    from scaletrain.layout import Layout

    lay = Layout("fsdp", 8, 1, 1, 4, tp=2)
    epochs = {r: list(itertools.islice(iter(make(lay.dp_size, lay.dp_rank(r))), SIZE // (BATCH * 4)))
              for r in range(8)}
    for r in range(0, 8, 2):
        assert all(torch.equal(a, b) for a, b in zip(epochs[r], epochs[r + 1]))  # one TP group, one batch
    seen = Counter(int(i) for r in range(8) if lay.reads(r) for batch in epochs[r] for i in batch)
    assert sum(seen.values()) == len(seen) == SIZE // (BATCH * 4) * BATCH * 4  # once each, the tail dropped
    assert [r for r in range(8) if lay.reads(r)] == [0, 2, 4, 6]
