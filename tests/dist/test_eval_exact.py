"""Evaluation across ranks is exact: every held-out sample once, and the same numbers as one process.

The held-out set has 359 samples (prime), so no world size divides it and a padded sampler would repeat
samples. Each spawned rank runs the real ``evaluate(job)`` on a Job from ``build_job`` (DDP over Gloo), with a
float64 model so that the loss sums agree to 1e-12 whatever order the ranks add them in; the accuracy is a
ratio of integer counts and must agree to the last bit.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn_ranks import run_ranks
from torch import nn
from torch.utils.data import Dataset

from scaletrain import runtime
from scaletrain.config import DistConfig, load
from scaletrain.data import eval_loader, in_memory
from scaletrain.train.evaluate import evaluate
from scaletrain.train.job import build_job

N_EVAL = 359
N_TRAIN = 64


class Recorded(Dataset):
    """(x[i], y[i]), remembering which indices were read (num_workers=0: in this process)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(int(i))
        return self.x[i], self.y[i]


class Linear64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        return self.lin(x.flatten(1).double())


def tensors() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_TRAIN + N_EVAL, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (N_TRAIN + N_EVAL,), generator=g)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def model() -> nn.Module:
    torch.manual_seed(0)
    return Linear64()


def index_is_correct(i: int) -> bool:
    """A fixed "model" that is right on some samples: a function of the sample index only."""
    return (i * 2654435761) % 7 < 3


def evaluate_here(world_expected: int) -> dict[str, Any]:
    """evaluate(job) on this process's rank, plus which samples it read."""
    rt = runtime.init(DistConfig(device="cpu"))
    try:
        assert rt.world_size == world_expected and rt.distributed == (world_expected > 1)
        cfg = load(None, overrides={"data.source": "memory", "data.batch_size": 4, "data.eval_batch_size": 16,
                                    "train.progress": False, "dist.device": "cpu"})
        x, y, xe, ye = tensors()
        recorded = Recorded(xe, ye)
        splits = in_memory((x, y), recorded)
        job = build_job(cfg, rt, splits, model())
        metrics = evaluate(job)
        # The same thing by hand through the loader: a fixed per-index "model", sums all-reduced.
        indices = [int(i) for batch in eval_loader(_Indices(N_EVAL), batch_size=16, rank=rt.rank,
                                                    world=rt.world_size) for i in batch]
        sums = torch.tensor([sum(index_is_correct(i) for i in indices), len(indices)], dtype=torch.int64)
        if rt.distributed:
            dist.all_reduce(sums)
        return {"metrics": metrics, "seen": recorded.seen, "indices": indices, "sums": sums.tolist()}
    finally:
        runtime.close(rt)


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _rank_body(rank: int, world: int) -> dict[str, Any]:
    return evaluate_here(world)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return evaluate_here(1)


def test_single_process_matches_a_direct_computation(single) -> None:
    _, _, xe, ye = tensors()
    with torch.no_grad():
        out = model()(xe)
    correct = int((out.argmax(-1) == ye).sum())
    m = single["metrics"]
    assert m["count"] == N_EVAL and m["correct"] == correct > 0
    assert m["accuracy"] == correct / N_EVAL
    assert abs(m["loss"] - F.cross_entropy(out, ye).item()) < 1e-12
    assert sorted(single["seen"]) == list(range(N_EVAL))
    assert single["sums"] == [sum(index_is_correct(i) for i in range(N_EVAL)), N_EVAL]


@pytest.mark.parametrize("world", [2, 3])
def test_eval_across_ranks_is_exact(world: int, single) -> None:
    assert N_EVAL % world != 0
    results = run_ranks(_rank_body, world)
    # Every held-out sample evaluated exactly once: no padding duplicates, none dropped.
    for key in ("seen", "indices"):
        counts = Counter(i for r in results for i in r[key])
        assert sorted(counts) == list(range(N_EVAL)) and set(counts.values()) == {1}, key
        sizes = [len(r[key]) for r in results]
        assert sizes == [len(range(rank, N_EVAL, world)) for rank in range(world)], key
    for rank, r in enumerate(results):
        assert r["indices"] == list(range(rank, N_EVAL, world))
        # The all-reduced integer sums equal the one-process ones; so does the accuracy, to the last bit.
        assert r["sums"] == single["sums"]
        m, ref = r["metrics"], single["metrics"]
        assert m["count"] == ref["count"] == N_EVAL
        assert m["correct"] == ref["correct"]
        assert m["accuracy"] == ref["accuracy"]
        assert abs(m["loss"] - ref["loss"]) < 1e-12
    assert all(r["metrics"] == results[0]["metrics"] for r in results)  # every rank reports the same


class _Pids(Dataset):
    """(x[i], y[i]), read in a worker process: each read appends that process's pid to ``path``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, path: str) -> None:
        self.x, self.y, self.path = x, y, path

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        return self.x[i], self.y[i]


def test_evaluations_share_one_loader_and_its_workers(tmp_path) -> None:
    """With data.num_workers > 0 every evaluation forked new loader workers (a fork after steps, each time); the
    loader and its workers are now made at the first evaluation and kept: three evaluations, one worker process,
    and the same metrics each time."""
    rt = runtime.init(DistConfig(device="cpu"))
    try:
        cfg = load(None, overrides={"data.source": "memory", "data.batch_size": 4, "data.eval_batch_size": 16,
                                    "data.num_workers": 1, "train.progress": False, "dist.device": "cpu"})
        x, y, xe, ye = tensors()
        pids = tmp_path / "pids"
        job = build_job(cfg, rt, in_memory((x, y), _Pids(xe, ye, str(pids))), model())
        results = [evaluate(job) for _ in range(3)]
    finally:
        runtime.close(rt)
    read = pids.read_text().split()
    assert len(read) == 3 * N_EVAL and len(set(read)) == 1 and int(read[0]) != os.getpid()
    assert results[0] == results[1] == results[2] and results[0]["count"] == N_EVAL
