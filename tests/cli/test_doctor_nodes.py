"""`scaletrain doctor --nodes N` and `--dist.check_network`, end to end: 3 "machines" as 3 torchrun agents on
loopback (1 worker each) measure the bandwidth between every two of them; one agent made slow by the check's
test hook (SCALETRAIN_TEST_SLOW_LINK_S: its first rank sleeps inside every timed exchange) is named."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from spawn_ranks import free_port

from scaletrain.cli import main
from scaletrain.cluster.pairwise import SLOW_HOOK_ENV

ME = [sys.executable, "-m", "scaletrain"]
SLOW_S = "0.1"  # per 16 MiB exchange that takes ~10-20 ms on this loopback: that node's links ~10x slower


def _agents(command: list[str], n: int, slow: int | None = None) -> list[tuple[subprocess.Popen[str], str, str]]:
    """The command as n agents at once, agent ``slow`` with the test hook; each (process, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != SLOW_HOOK_ENV} | {"OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env | ({SLOW_HOOK_ENV: SLOW_S} if i == slow else {})) for i in range(n)]
    return [(p, *p.communicate(timeout=300)) for p in procs]


def _doctor(n: int, slow: int | None = None) -> list[tuple[subprocess.Popen[str], str, str]]:
    return _agents([*ME, "doctor", "--nodes", str(n), "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--json"], n, slow)


def _matrix_ok(result: dict) -> None:
    m = result["bytes_per_s"]
    assert len(m) == 3 and all(len(row) == 3 for row in m)
    assert all(m[i][i] is None for i in range(3))
    assert all(m[i][j] == m[j][i] and m[i][j] > 0 for i in range(3) for j in range(3) if i != j)
    assert [node["host"] for node in result["nodes"]] == [socket.gethostname()] * 3
    assert [node["node"] for node in result["nodes"]] == [0, 1, 2]
    assert (result["size_bytes"], result["iters"], result["backend"]) == (16 * 2**20, 5, "gloo")


PAIRWISE = "mkdir -p runs; for i in 1 2 3; do scaletrain doctor --nodes 3"  # docs/multinode.md's three agents on loopback


def test_three_nodes_measure_a_matrix_and_each_prints_the_same(documented) -> None:
    """docs/multinode.md's three `doctor --nodes 3` agents on loopback, as the docs tour ran them (each one's
    report in runs/pairwise-N.txt): every machine prints the same 3 x 3 table, and a verdict."""
    tour = documented(PAIRWISE)
    ran = tour.find(PAIRWISE)
    assert ran.proc is not None and ran.proc.returncode == 0, ran.problem or ran.note
    said = [(tour.workspace / "runs" / f"pairwise-{i}.txt").read_text() for i in (1, 2, 3)]
    assert said[0] == said[1] == said[2], said
    lines = said[0].splitlines()
    assert lines[0] == "pairwise bandwidth, GB/s each way (16 MiB both ways at once, median of 5; gloo, cpu)"
    rows = [line for line in lines if line.startswith("│")]
    assert [row.split()[1] for row in rows] == ["0", "1", "2"] and all(row.count(" - ") == 1 for row in rows)
    # on a busy 2-core machine loopback may look uneven by chance: then a node or link is named
    assert lines[-1].startswith(("network even: 3 links ", "slow node: ", "slow link: ")), lines[-1]


def test_the_slow_node_is_named_with_its_host() -> None:
    runs = _doctor(3, slow=1)
    assert [proc.returncode for proc, _, _ in runs] == [1, 1, 1], [err[-2000:] for _, _, err in runs]
    result = json.loads(runs[0][1])
    assert all(json.loads(out) == result for _, out, _ in runs)  # every machine prints the same report
    _matrix_ok(result)
    slow_agent = runs[1][0].pid
    [slow_node] = [node["node"] for node in result["nodes"] if node["launcher_pid"] == slow_agent]
    assert [(s["kind"], s["nodes"], s["hosts"]) for s in result["slow"]] == [
        ("node", [slow_node], [socket.gethostname()])]
    assert result["slow"][0]["gb_per_s"] < 0.5 * result["slow"][0]["others_gb_per_s"]
    assert result["lines"][0].startswith(f"slow node: node {slow_node} ({socket.gethostname()}): its links ")


def test_check_network_before_step_0_warns_on_rank_0_and_the_run_goes_on(tmp_path: Path) -> None:
    port = free_port()
    runs = _agents([*ME, "train", "digits", "--nproc", "1", "--nnodes", "3", f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--dist.rdzv_id=check-{os.getpid()}", "--dist.check_network=true", "--train.max_steps=2",
                    f"--run.dir={tmp_path / 'run'}", "--train.progress=false", "--train.eval_batches=1"], 3, slow=2)
    assert [proc.returncode for proc, _, _ in runs] == [0, 0, 0], [err[-2000:] for _, _, err in runs]
    said = [line for _, _, err in runs for line in err.splitlines() if "network check" in line]
    assert len(said) == 1, said  # rank 0 alone
    assert said[0].startswith("scaletrain: warning: network check before step 0: slow node: node ")
    assert f"({socket.gethostname()}): its links " in said[0]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize(("argv", "says"), [
    (["--nodes", "1", "--rdzv-endpoint", "127.0.0.1:29500"], "--nodes = '1': expected an integer >= 2"),
    (["--nodes", "3"], "--nodes 3 needs --rdzv-endpoint HOST:PORT"),
    (["--nodes", "3", "--rdzv-endpoint", "node0:99999"], "dist.rdzv_endpoint = 'node0:99999'"),
    (["--nodes", "3", "--rdzv-endpoint", "node0"], "expected HOST:PORT with a port in [1, 65535]"),
    (["--rdzv-endpoint", "node0:29500"], "--rdzv-endpoint is for the check between machines"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", *argv]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("scaletrain: error: ") and says in line and "; fix: " in line
