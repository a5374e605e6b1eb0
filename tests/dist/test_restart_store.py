"""A restarted group under torchrun's shared agent store: its ranks must meet in one namespace that no earlier
group of the job used, whatever each agent's TORCHELASTIC_RESTART_COUNT says.

On two machines each agent keeps its own restart count: the one whose worker died counts 1, the other restarts
its workers because the membership changed and still counts 0. With the group's keys under the count, the two
ranks of the restarted group waited on different keys until dist.timeout_s (one of them read a dead worker's
Gloo address: "connectFullMesh failed ... Connection refused"). Here two ranks run two rounds of a job against
one agent store that outlives them (as the agent's does): a first round (both counting 0) opening two groups in
a row (fit() twice), its last group recording a failure; then a second round whose ranks count 1 and 0.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import run_ranks

from scaletrain.errors import TrainingFailed

TIMEOUT_S = 10  # dist.timeout_s of every group here: a rank that waits on the wrong keys fails within it
WORLD = 2


def _rank(rank: int, world: int, counts: tuple[int, ...], record_failure: bool) -> list[dict[str, Any]]:
    """One worker of one round: two groups in a row (fit() twice), each one all_reduce; what each group saw."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(counts[rank])
    from scaletrain import runtime
    from scaletrain.config import DistConfig

    seen = []
    for group in range(2):
        rt = runtime.init(DistConfig(device="cpu", timeout_s=TIMEOUT_S))
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        seen.append({"sum": total.item(), "previous": runtime.previous_failure(rt)})
        if record_failure and group == 1 and rank == 0:  # rank 1 "died": rank 0 alone reports the failure
            runtime.missing_peers(rt, step=7, wait_s=0.2)
        dist.barrier()
        runtime.close(rt)
    return seen


def _round(agent: dist.TCPStore, counts: tuple[int, ...], record_failure: bool = False) -> list[Any]:
    """Both ranks of one round against the job's agent store."""
    return run_ranks(_rank, WORLD, counts, record_failure, timeout_s=3 * TIMEOUT_S, store=agent)


def test_a_restarted_group_whose_agents_count_restarts_differently_meets_in_one_namespace():
    agent = dist.TCPStore("127.0.0.1", 0, world_size=WORLD, is_master=True, wait_for_workers=False)
    first = _round(agent, (0, 0), record_failure=True)
    assert [g["sum"] for r in first for g in r] == [3.0] * 4
    started = time.monotonic()
    second = _round(agent, (1, 0))  # the agent of rank 0 counted the failure, rank 1's did not
    assert time.monotonic() - started < TIMEOUT_S  # no rank waited on keys nobody else writes
    assert [g["sum"] for r in second for g in r] == [3.0] * 4
    # What the first round's last group recorded, read by the next group of the job on every rank alike; the
    # second group of the round has no failure before it.
    assert [r[0]["previous"] for r in second] == [{"step": 7, "missing": "1"}] * WORLD
    assert [r[1]["previous"] for r in second] == [{}] * WORLD


def _alone(rank: int, stale: bool) -> str:
    """``rank`` of 2 joining with no peer alive (a store holding an earlier round's keys when ``stale``): the error."""
    from scaletrain import runtime

    agent = dist.TCPStore("127.0.0.1", 0, world_size=WORLD, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    if stale:  # an earlier group that met: each rank's hello answered, both joined
        store = runtime._agent_store("127.0.0.1", agent.port, timedelta(seconds=5))
        store.set("scaletrain/join/hello/1", "old")
        store.set("scaletrain/join/answer/old", "1")
        store.add("scaletrain/groups", 1)
    client = runtime._agent_store("127.0.0.1", agent.port, timedelta(seconds=5))
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as err:
        runtime._meet(client, rank, WORLD, timedelta(seconds=1))
    assert time.monotonic() - started < 4
    line = str(err.value)
    assert "\n" not in line and "--dist.timeout_s" in line
    return line


def test_a_rank_whose_group_never_forms_fails_in_one_line_within_dist_timeout_s():
    assert "rank 0" in _alone(1, stale=False)
    assert "rank 0" in _alone(1, stale=True)  # an earlier round's answer is no answer to this one
    assert "rank 1" in _alone(0, stale=True)  # nor is an earlier round's hello
