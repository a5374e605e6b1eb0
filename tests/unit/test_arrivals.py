"""observe/arrivals.py: a rank's lateness per step in its tensor-parallel group's collectives, from made-up
issue times (the session feeds it each rank's Flight Recorder reading)."""

from __future__ import annotations

import pytest

from scaletrain.observe.arrivals import lateness


def _row(mean_s: float, first: int = 1, last: int = 40, since: int = 40) -> list[float]:
    return [mean_s, float(first), float(last), float(since)]


def test_a_rank_late_at_every_collective_is_late_by_the_sum_per_step():
    # 40 collectives over 10 steps (4 a step); rank 1 issues each 5 ms after rank 0: 20 ms of its own per step
    late = lateness([_row(100.0), _row(100.005)], [[0, 1]], 10, before=[0.001, 0.001])
    assert late[0] == 0.0 and late[1] == pytest.approx(0.020, abs=1e-6)


def test_lateness_already_counted_before_forward_is_not_counted_twice():
    # rank 1 waits 30 ms for its data each step: late at the step's first collective only (30 ms / 4 on average)
    late = lateness([_row(100.0), _row(100.0075)], [[0, 1]], 10, before=[0.001, 0.031])
    assert late[1] == pytest.approx(0.0, abs=1e-6)


def test_groups_are_separate_and_a_group_that_read_other_collectives_is_skipped():
    rows = [_row(50.0), _row(50.002), _row(70.0, last=41), _row(70.009, last=40)]
    late = lateness(rows, [[0, 1], [2, 3]], 10, before=[0.0] * 4)
    assert late[1] == pytest.approx(0.008, abs=1e-6) and late[2:] == [0.0, 0.0]
    assert lateness([[0.0] * 4] * 2, [[0, 1]], 10, before=[0.0, 0.0]) == [0.0, 0.0]  # nothing recorded


def test_reading_is_spaced_to_cost_at_most_half_a_percent():
    from scaletrain.observe.arrivals import every

    rows = [[0.0, 1.0, 40.0, 40.0, 0.019], [0.0, 1.0, 40.0, 40.0, 0.012]]  # the slowest read counts: 19 ms
    assert every(rows, 10.0) == 1  # 0.19% of a 10 s interval: every log step
    assert every(rows, 0.35) == 11  # 19 ms against 0.5% of 350 ms (1.75 ms): every 11th log step
    assert every([], 1.0) == 1 and every(rows, 0.0) == 1
