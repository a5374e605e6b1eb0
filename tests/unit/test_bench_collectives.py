"""bench allreduce's expected values and checks: the patterns by hand, every op right on 3 ranks at a size
that does not split evenly, and a wrong result stopping the benchmark instead of becoming a number."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import run_ranks

from scaletrain.bench.collectives import (
    CollectiveMismatch,
    _summed,
    check_backend,
    dist_config,
    elements,
    make_case,
    measure,
    pattern,
)
from scaletrain.bench.units import OPS
from scaletrain.errors import ConfigError

CPU = torch.device("cpu")


def test_patterns_by_hand():
    assert pattern(9, rank=1, device=CPU).tolist() == [2, 3, 4, 5, 6, 7, 8, 2, 3]  # 2 + i % 7
    assert pattern(3, rank=0, device=CPU, offset=6).tolist() == [7, 1, 2]
    # sum over 3 ranks of (r + 1 + i % 7) = 6 + 3 x (i % 7)
    assert _summed(8, world=3, device=CPU).tolist() == [6, 9, 12, 15, 18, 21, 24, 6]
    assert _summed(2, world=3, device=CPU, offset=6).tolist() == [24, 6]
    summed = sum(pattern(50, r, CPU, offset=5) for r in range(4))
    assert torch.equal(summed, _summed(50, 4, CPU, offset=5))


def test_sizes_round_down_to_whole_elements_per_rank():
    assert elements(1024, 2) == 256
    assert elements(1000, 3) == 249  # 250 floats, rounded down to a multiple of 3
    assert elements(4, 2) == 0


def test_a_case_checks_its_own_output():
    case = make_case("broadcast", 64, rank=0, world=1, device=CPU)
    case.reset()
    assert case.check() is None  # broadcast from rank 0 on one rank: the input is the answer
    case.output[5] = 0.0
    assert "1 of 16 values wrong; first at index 5: got 0.0, expected 6.0" == case.check()


def test_backend_choice_lives_in_one_place():
    assert dist_config("gloo").device == "cpu" and dist_config("nccl").device == "cuda"
    assert dist_config("auto").device == "auto" and dist_config("auto").backend == "auto"
    check_backend("gloo", 8)  # no GPU needed


def _on_each_rank(rank: int, world: int) -> dict:
    """Every op done right, then two ops whose result is made wrong on rank 1 (one spawn for both tests)."""
    dist.init_process_group("gloo")
    # 1002 bytes: 250 floats (the 2 leftover bytes dropped), 125 per rank, so chunks do not align with the
    # pattern's period of 7 and a misplaced chunk would show.
    results = [measure(make_case(op, 1002, rank, world, CPU), rank, world, CPU, iters=2, warmup=1) for op in OPS]
    messages = {}
    for op in ("all_reduce", "reduce_scatter"):
        case = make_case(op, 1024, rank, world, CPU)

        def wrong(case=case, real=case.run) -> None:
            real()
            if rank == 1:
                case.output[3] += 1  # one value off on one rank

        case.run = wrong
        try:
            measure(case, rank, world, CPU, iters=2, warmup=1)
            messages[op] = "no error"
        except CollectiveMismatch as err:
            messages[op] = str(err)
    return {"results": results, "messages": messages}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_on_each_rank, 2, timeout_s=120)


def test_every_op_is_correct_on_two_ranks(two_ranks):
    results = [r["results"] for r in two_ranks]
    assert [r["op"] for r in results[0]] == list(OPS)
    for r in results[0]:
        assert r["size_bytes"] == 1000 and r["count"] == 250 and r["checked_iters"] == 3
        assert r["time_s"] > 0 and r["busbw_gb_per_s"] > 0
    # every rank reports the same (slowest-rank) times
    assert [r["time_s"] for r in results[0]] == [r["time_s"] for r in results[1]]


def test_a_wrong_result_is_an_error_on_every_rank(two_ranks):
    per_rank = [r["messages"] for r in two_ranks]
    for op in ("all_reduce", "reduce_scatter"):
        for messages in per_rank:
            assert f"{op} of 1KB on 2 ranks returned wrong values on rank(s) [1]" in messages[op], messages
        assert "first at index 3" in per_rank[1][op] and "iteration 0" in per_rank[1][op]


def test_nccl_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_backend("nccl", 2)
    check_backend("gloo", 8)
    for backend in ("nccl", "auto"):  # auto means nccl on a CUDA machine
        with pytest.raises(ConfigError) as info:
            check_backend(backend, 3)
        assert f"--nproc = 3: expected at most 2 with --backend {backend}" in str(info.value)
        assert "fix: --nproc 2, or --backend gloo" in str(info.value)
