"""The pairwise network check's pure parts (cluster/pairwise.py): the round-robin schedule, and what it names
in made-up bandwidth matrices (bytes/s)."""

from __future__ import annotations

from itertools import combinations

import pytest

from scaletrain.cluster.pairwise import SLOW_RATIO, Slow, even_line, find_slow, rounds

HOSTS = ["node-a", "node-b", "node-c", "node-d", "node-e"]
GB = 1e9


def _matrix(n: int, gbps: float = 10.0, **links: float) -> list[list[float | None]]:
    """n nodes, every link ``gbps`` GB/s but those given as i_j=GB/s."""
    m: list[list[float | None]] = [[None if i == j else gbps * GB for j in range(n)] for i in range(n)]
    for name, value in links.items():
        i, j = map(int, name[1:].split("_"))
        m[i][j] = m[j][i] = value * GB
    return m


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_rounds_pair_every_two_nodes_once_in_disjoint_rounds(n: int) -> None:
    schedule = rounds(n)
    assert len(schedule) == (n - 1 if n % 2 == 0 else n)
    pairs = [pair for one in schedule for pair in one]
    assert sorted(pairs) == list(combinations(range(n), 2))
    for one in schedule:
        busy = [node for pair in one for node in pair]
        assert len(busy) == len(set(busy))  # a node is in at most one pair per round


def test_an_even_network_names_nothing() -> None:
    jittery = _matrix(4, _0_1=8.0, _2_3=12.0, _1_3=9.5)  # within 20%: noise, not a fault
    assert find_slow(jittery, HOSTS[:4]) == []
    assert even_line(jittery) == "network even: 6 links 8.00-12.00 GB/s (median 10.00), none below 0.5x its peers"


def test_one_slow_node_is_named_with_its_host_and_the_numbers() -> None:
    m = _matrix(4, _2_0=2.0, _2_1=3.0, _2_3=2.5)
    assert find_slow(m, HOSTS[:4]) == [Slow("node", (2,), ("node-c",), 2.5, 10.0)]
    line = find_slow(m, HOSTS[:4])[0].line()
    assert line.startswith("slow node: node 2 (node-c): its links 2.50 GB/s, the other links' median 10.00 GB/s")
    assert "; fix: " in line


def test_a_slow_node_among_three() -> None:
    m = _matrix(3, _1_0=0.3, _1_2=0.4)
    assert find_slow(m, HOSTS[:3]) == [Slow("node", (1,), ("node-b",), pytest.approx(0.35), 10.0)]


def test_one_slow_link_is_named_not_its_nodes() -> None:
    m = _matrix(4, _1_3=3.0)
    assert find_slow(m, HOSTS[:4]) == [Slow("link", (1, 3), ("node-b", "node-d"), 3.0, 10.0)]
    assert find_slow(m, HOSTS[:4])[0].line().startswith(
        "slow link: node 1 (node-b) <-> node 3 (node-d): 3.00 GB/s, their other links' median 10.00 GB/s")


def test_a_link_just_above_the_threshold_is_not_slow() -> None:
    assert find_slow(_matrix(4, _0_1=10.0 * SLOW_RATIO + 0.01), HOSTS[:4]) == []
    assert find_slow(_matrix(4, _0_1=10.0 * SLOW_RATIO - 0.01), HOSTS[:4]) != []


def test_a_slow_node_and_an_unrelated_slow_link_are_both_named() -> None:
    m = _matrix(5, _4_0=1.0, _4_1=1.0, _4_2=1.0, _4_3=1.0, _0_1=2.0)
    assert [(s.kind, s.nodes) for s in find_slow(m, HOSTS)] == [("node", (4,)), ("link", (0, 1))]


def test_two_nodes_have_nothing_to_compare() -> None:
    m = _matrix(2, _0_1=0.1)
    assert find_slow(m, HOSTS[:2]) == []
    assert even_line(m).startswith("one link, 0.10 GB/s: nothing to compare it with")


def test_check_network_on_one_machine_says_it_checked_nothing(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from scaletrain import runtime
    from scaletrain.config import DistConfig

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    rt = runtime.init(DistConfig(device="cpu", check_network=True))
    assert rt.world_size == 1
    [said] = capsys.readouterr().err.splitlines()
    assert said == ("scaletrain: warning: dist.check_network is set but this job runs on one machine: no link "
                    "between machines to measure, nothing checked")
