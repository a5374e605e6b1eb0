"""A training stream (an IterableDataset) gives each rank the batches a map-style data set gives it unshuffled:
the same positions per micro-step and rank, the same tail rule, the same resume at another world size or
batch; and fit() trains on one, needing only train.max_steps."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

import scaletrain
from scaletrain.config import load
from scaletrain.data import ShardedLoader, StreamLoader, TensorPairs
from scaletrain.errors import ConfigError, UserError
from scaletrain.train.batching import plan_batches

N = 301  # 301 items: every step size below leaves a tail


class Counting(IterableDataset):
    """Items (x = [i], y = i) in order; counts its passes and the epochs it was told."""

    def __init__(self, n: int = N) -> None:
        self.n, self.passes, self.epochs = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        self.passes += 1
        for i in range(self.n):
            yield torch.tensor([float(i)]), i


def _ids(batch) -> list[int]:
    return batch[1].tolist()


def _indexed(rank: int, world: int, b: int, accum: int) -> ShardedLoader:
    data = TensorPairs(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N))
    return ShardedLoader(data, batch_size=b, rank=rank, world=world, accum=accum, seed=0, shuffle=False)


@pytest.mark.parametrize("world, b, accum", [(1, 8, 1), (2, 4, 2), (3, 5, 1)])
def test_every_rank_gets_what_an_unshuffled_indexed_loader_gives_it_over_two_passes(world, b, accum) -> None:
    per_pass = N // (b * world * accum) * accum  # micro-batches per rank per pass (whole steps only)
    for rank in range(world):
        stream = StreamLoader(Counting(), batch_size=b, rank=rank, world=world, accum=accum)
        got = [_ids(x) for x in itertools.islice(iter(stream), 2 * per_pass)]
        want = [_ids(x) for x in itertools.islice(iter(_indexed(rank, world, b, accum)), 2 * per_pass)]
        assert got == want and stream.epoch == 1
    seen = {i for rank in range(world) for x in itertools.islice(
        iter(StreamLoader(Counting(), batch_size=b, rank=rank, world=world, accum=accum)), per_pass) for i in _ids(x)}
    assert len(seen) == per_pass * b * world  # disjoint across ranks: no item twice in a pass


@pytest.mark.parametrize("world_after, accum_after", [(2, 2), (1, 4), (4, 1)])
def test_a_resume_at_another_world_size_continues_with_the_next_unseen_item(world_after, accum_after) -> None:
    """Saved after 7 steps of 2 ranks x 4 x accumulation 2, resumed at another layout: the same batches as
    the indexed loader resumed from the same state (the rest of the pass cut into whole steps of the new size)."""
    before = StreamLoader(Counting(), batch_size=4, rank=0, world=2, accum=2)
    list(itertools.islice(iter(before), 7 * 2))
    state = before.state_dict()
    assert (state["epoch"], state["cursor"]) == (0, 7 * 16)
    for rank in range(world_after):
        data = Counting()
        after = StreamLoader(data, batch_size=4, rank=rank, world=world_after, accum=accum_after)
        after.load_state_dict(state)
        indexed = _indexed(rank, world_after, 4, accum_after)
        indexed.load_state_dict({**state, "size": N, "end": N})
        assert [_ids(x) for x in itertools.islice(iter(after), 40)] == \
            [_ids(x) for x in itertools.islice(iter(indexed), 40)]
        assert data.epochs == list(range(data.passes))  # each pass told its epoch (a shuffled stream reshuffles)


def test_states_of_the_other_kind_and_short_streams_are_one_line() -> None:
    with pytest.raises(UserError, match="read a data set by index, this run a stream"):
        StreamLoader(Counting(), batch_size=4, rank=0, world=1, accum=1).load_state_dict({"epoch": 0, "cursor": 8})
    resumed = StreamLoader(Counting(10), batch_size=4, rank=0, world=1, accum=1)
    resumed.load_state_dict({"epoch": 0, "cursor": 40, "stream": 1})
    with pytest.raises(UserError, match="ended after 10 items of the 40"):
        next(iter(resumed))
    with pytest.raises(UserError, match="fewer than 16 items"):
        next(iter(StreamLoader(Counting(10), batch_size=8, rank=0, world=2, accum=1)))


def test_a_stream_needs_max_steps_and_has_no_epochs() -> None:
    with pytest.raises(ConfigError) as exc:
        plan_batches(load(None, cli_overrides={"data.batch_size": "8"}), 2, None)
    assert "train.max_steps" in str(exc.value) and "--train.max_steps=" in str(exc.value)
    plan = plan_batches(load(None, cli_overrides={"data.batch_size": "8", "train.max_steps": "30"}), 2, None)
    assert (plan.steps_per_epoch, plan.total_steps, plan.global_batch) == (0, 30, 16)


class Points(IterableDataset):
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.n):
            x = torch.randn(8, generator=g)
            yield x, int(x.sum() > 0)


def test_fit_trains_on_a_stream_with_a_held_out_list_or_stream(tmp_path: Path) -> None:
    summary = scaletrain.fit(lambda: torch.nn.Linear(8, 2), Points(1000, 0), eval_data=list(Points(256, 1)),
                             config={"train.max_steps": 100, "data.batch_size": 16, "optim.lr": 0.05,
                                     "train.progress": False, "run.dir": str(tmp_path / "s")})
    assert summary["steps"] == 100 and summary["epochs"] == 1.0  # 62 steps a pass: one pass completed
    # the sign of a sum of 8 normals, linearly separable: measured 99.2%; chance is 50%
    assert summary["eval"]["count"] == 256.0 and summary["eval"]["accuracy"] >= 0.95
    # the same held-out samples as a stream: read whole at each evaluation, the same metrics (the same training)
    streamed = scaletrain.fit(lambda: torch.nn.Linear(8, 2), Points(1000, 0), eval_data=Points(256, 1),
                              config={"train.max_steps": 100, "data.batch_size": 16, "optim.lr": 0.05,
                                      "train.progress": False, "run.dir": str(tmp_path / "e")})
    assert streamed["eval"]["count"] == 256.0 and streamed["eval"]["correct"] == summary["eval"]["correct"]
    assert streamed["eval"]["loss"] == pytest.approx(summary["eval"]["loss"], rel=1e-6)
    # train.eval_batches reads the stream's first batches only: 2 of 16
    capped = scaletrain.fit(lambda: torch.nn.Linear(8, 2), Points(1000, 0), eval_data=Points(250, 1),
                            config={"train.max_steps": 10, "data.batch_size": 16, "train.eval_batches": 2,
                                    "train.progress": False, "run.dir": str(tmp_path / "c")})
    assert capped["eval"]["count"] == 32.0
