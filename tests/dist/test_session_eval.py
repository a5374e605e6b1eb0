"""A loop of one's own evaluating with a session's loader: read inside st.evaluating(), a loader gives every sample
of its data set once over the ranks, in as many batches on every rank (FSDP's collective forward runs as often
everywhere), and leaves the training position as it was. Before, it went on through its training epochs: the tail
of a step's worth was dropped (96 of 100 held-out samples on 2 ranks at batch 16). A held-out stream (an
IterableDataset) too: read from its start, its tail kept, the last two chunks split evenly over the ranks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import safetensors.torch
import torch
from spawn_ranks import run_ranks

from scaletrain.data.loader import ShardedLoader, StreamLoader

HELD_OUT = 37  # not a multiple of batch x world: a tail the training rule would drop


@pytest.mark.parametrize(("size", "batch", "world"), [(37, 8, 2), (100, 16, 2), (96, 16, 2), (10, 4, 3),
                                                      (64, 1, 4), (1797, 64, 3), (5, 16, 2)])
def test_a_whole_pass_is_every_sample_once_in_as_many_batches_on_every_rank(size, batch, world):
    passes = [ShardedLoader(list(range(size)), batch_size=1 if size < batch * world else batch, rank=r, world=world,
                            accum=1, seed=3, shuffle=True).whole_pass_batches() for r in range(world)]
    if size >= batch * world:
        assert {len(p) for p in passes} == {-(-size // (batch * world))}  # ceil(size / (batch x world)) each
        assert all(0 < len(b) <= batch for b in itertools.chain(*passes))
    assert sorted(itertools.chain(*itertools.chain(*passes))) == list(range(size))


class Items(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize(("size", "batch", "world"), [(37, 8, 2), (100, 16, 2), (96, 16, 2), (10, 4, 3),
                                                      (1797, 64, 3), (5, 16, 2), (17, 2, 4)])
def test_a_streams_whole_pass_is_every_item_once_in_as_many_batches_on_every_rank(size, batch, world):
    passes = []
    for r in range(world):
        loader = StreamLoader(Items(size), batch_size=batch, rank=r, world=world, accum=1,
                              collate_fn=lambda items: items)
        passes.append(list(loader.whole_pass()))
        assert (loader.epoch, loader.cursor) == (0, 0)  # the loader's own position did not move
    if size >= batch * world:
        assert {len(p) for p in passes} == {-(-size // (batch * world))}  # ceil(size / (batch x world)) each
        assert all(0 < len(b) <= batch for b in itertools.chain(*passes))
    assert sorted(itertools.chain(*itertools.chain(*passes))) == list(range(size))


class Indexed(torch.utils.data.Dataset):
    """Sample i: (its index as a float feature row, a class)."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(i), self.x[i], torch.tensor(i % 3)


class IndexedStream(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = Indexed(n)

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def _loop(rank: int, world: int, where: str, strategy: str, evaluate: bool, stream: bool = False) -> list[list[int]]:
    """8 steps of a small classifier; with ``evaluate``, a held-out pass at steps 3 and 6 (the indices each rank
    saw, per pass)."""
    import torch.distributed as dist

    import scaletrain

    seen: list[list[int]] = []
    cfg = {"run.dir": str(Path(where) / f"{strategy}-{evaluate}"), "train.max_steps": 8, "log.every": 4,
           "data.batch_size": 8, "parallel.strategy": strategy, "checkpoint.every": 100, "train.progress": False}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
                              lambda p: torch.optim.SGD(p, lr=0.1))
        loader = st.loader(Indexed(64))
        val = st.loader(IndexedStream(HELD_OUT) if stream else Indexed(HELD_OUT), shuffle=False)
        while not st.done:
            for _, x, y in loader:
                with st.step():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    st.backward(loss)
                    opt.step()
                    opt.zero_grad()
                if evaluate and st.steps in (3, 6):
                    with st.evaluating(), torch.no_grad():
                        mine, batches = [], 0
                        for idx, x, _ in val:
                            model(x)  # under FSDP a collective: every rank runs as many
                            mine += idx.tolist()
                            batches += 1
                        assert stream or len(val) == batches  # a stream's length is unknown
                    counts = [0] * world
                    dist.all_gather_object(counts, batches)
                    assert len(set(counts)) == 1, counts
                    seen.append(mine)
                if st.done:
                    break
    return seen


def _both(rank: int, world: int, where: str, strategy: str, stream: bool) -> list[list[int]]:
    _loop(rank, world, where, strategy, evaluate=False)
    return _loop(rank, world, where, strategy, evaluate=True, stream=stream)


@pytest.mark.parametrize(("strategy", "stream"), [("ddp", False), ("fsdp", False), ("fsdp", True)])
def test_an_evaluation_in_a_loop_sees_every_held_out_sample_once_and_training_is_unchanged(tmp_path, strategy,
                                                                                            stream):
    per_rank = run_ranks(_both, 2, str(tmp_path), strategy, stream)
    for evaluation in zip(*per_rank):  # each pass: the ranks' indices together are the held-out set, once each
        assert sorted(itertools.chain(*evaluation)) == list(range(HELD_OUT))
    assert len(per_rank[0]) == 2
    weights = [safetensors.torch.load_file(str(tmp_path / f"{strategy}-{e}" / "model.safetensors")) for e in (False, True)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # bitwise: nothing drawn or moved


class Pairs(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = Indexed(n)

    def __iter__(self):
        return (self.data[i][1:] for i in range(len(self.data)))


def _fit_held_out(rank: int, world: int, where: str, stream: bool) -> dict:
    import scaletrain

    held = Pairs(HELD_OUT) if stream else list(Pairs(HELD_OUT))
    return scaletrain.fit(lambda: torch.nn.Linear(4, 3), list(Pairs(64)), eval_data=held, config={
        "run.dir": str(Path(where) / f"fit-{stream}"), "train.max_steps": 4, "data.batch_size": 8,
        "parallel.strategy": "fsdp", "train.progress": False})["eval"]


def test_fit_evaluates_a_held_out_stream_under_fsdp_as_the_same_samples_listed(tmp_path):
    """37 held-out items in batches of 8 on 2 ranks: every item counted once (the tail split over both ranks,
    as many forwards on each), the same metrics as the list of them."""
    listed = run_ranks(_fit_held_out, 2, str(tmp_path), False)[0]
    streamed = run_ranks(_fit_held_out, 2, str(tmp_path), True)[0]
    assert streamed["count"] == listed["count"] == HELD_OUT and streamed["correct"] == listed["correct"]
    assert streamed["loss"] == pytest.approx(listed["loss"], rel=1e-6)
