"""scaletrain cluster rehearse: a 2-node job as two torchrun agents on loopback computes what one node of 4
ranks does at the same global batch (weights within 1e-6), and reports the world, the bandwidth and the command.
With --netns (where this machine lets a test make network namespaces: root and iproute2), each node has its own
network stack and a link shaped to --link-gbps: the job listens only on the nodes' own addresses, carries no
more than the link's rate between them, computes what one node does, and leaves no namespace behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from test_sockets import _watch
from warm import SCALETRAIN_M

from scaletrain.cluster import netns

ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
RUN = ["--train.progress=false", "--train.eval_batches=1", "--log.every=4"]


def _scaletrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCALETRAIN_M, *args], capture_output=True, text=True, env=ENV,
                          timeout=600, check=False)


def test_two_nodes_of_two_ranks_equal_one_node_of_four(tmp_path: Path, documented) -> None:
    """The rehearsal docs/multinode.md shows, as typed (the docs tour's run of it), against one node of 4."""
    command = "scaletrain cluster rehearse --nodes 2 --nproc 2 digits --steps 4 --out runs/rehearse"
    tour = documented(command)
    rehearsed, rehearsal = tour.find(command).proc, tour.workspace / "runs" / "rehearse"
    assert rehearsed is not None and rehearsed.returncode == 0, tour.find(command).problem
    out = rehearsed.stdout
    assert "rehearsal: 2 nodes x 2 ranks on this machine" in out and "world 4, gloo" in out
    assert "between the nodes' first ranks" in out
    assert ("on 2 real machines, run on each: scaletrain train digits --nproc=2 --nnodes=2 "
            "--rdzv-endpoint=FIRST_MACHINE:29500 --dist.rdzv_id=JOB_ID") in out
    net = json.loads((rehearsal / "net.json").read_text())
    assert net["nodes"] == 2 and sorted(r["rank"] for r in net["ranks"]) == [0, 1, 2, 3]
    assert sorted((r["node"], r["local_rank"]) for r in net["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]

    one = _scaletrain("train", "digits", "--nproc", "4", "--train.max_steps=4", f"--run.dir={tmp_path / 'one'}", *RUN)
    assert one.returncode == 0, one.stderr[-2000:]
    assert _same_weights(rehearsal / "run", tmp_path / "one") <= 1e-6
    summary = json.loads((rehearsal / "run" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_batch"] == 128 and summary["steps"] == 4
    assert torch.isfinite(torch.tensor(summary["train_loss"]))


def _same_weights(a_run: Path, b_run: Path) -> float:
    a = safetensors.torch.load_file(str(a_run / "model.safetensors"))
    b = safetensors.torch.load_file(str(b_run / "model.safetensors"))
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


WHY_NOT = netns.unavailable(shaped=True)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")
def test_nodes_in_network_namespaces_on_a_shaped_link(tmp_path: Path) -> None:
    out = tmp_path / "ns"
    # A new interpreter, not a fork of the warm one (tests/warm.py): _watch finds the rehearsal's processes as
    # the descendants of the one it starts.
    rehearse = [sys.executable, "-m", "scaletrain", "cluster", "rehearse", "--nodes", "2", "--nproc", "1", "digits",
                "--steps", "4", "--link-gbps", "0.5", "--out", str(out), *RUN]
    seen = _watch([rehearse], tmp_path)  # every listener of the rehearsal's processes, in their own namespaces
    said = (tmp_path / "agent0.log").read_text()
    assert ("rehearsal: 2 nodes x 1 ranks on this machine (2 torchrun agents, each in a network namespace of its "
            "own, on a bridge, links of 0.5 Gbit/s, a c10d rendezvous at 10.213.0.1:29500): world 2, gloo") in said
    assert "node 1: ranks 1 on node1 at 10.213.0.2, a 0.5 Gbit/s link" in said, said
    # The stores and the Gloo pairs listen on the nodes' own addresses only: not loopback, not every interface
    assert {addr for _, addr, _ in seen} == {"10.213.0.1", "10.213.0.2"}, seen
    assert {("10.213.0.1", 29400), ("10.213.0.1", 29500)} <= {(a, p) for _, a, p in seen}, seen  # rendezvous
    # The shaper holds the link to 0.5 Gbit/s = 62.5 MB/s (its 10 ms burst aside)
    net = json.loads((out / "rehearsal.json").read_text())["net"]
    assert 0 < net["between_nodes_busbw"] <= 0.5e9 / 8 * 1.05, net
    assert not [n for n in netns._existing() if n.startswith("st-")]  # nothing left behind
    assert not list(Path("/etc/netns").glob("st-*"))

    one = _scaletrain("train", "digits", "--nproc", "2", "--train.max_steps=4", f"--run.dir={tmp_path / 'one'}", *RUN)
    assert one.returncode == 0, one.stderr[-2000:]
    assert _same_weights(out / "run", tmp_path / "one") <= 1e-6


def test_what_the_rehearsal_sets_cannot_be_given(tmp_path: Path) -> None:
    done = tmp_path / "done"
    (done / "run").mkdir(parents=True)
    (done / "run" / "summary.json").write_text("{}")
    again = _scaletrain("cluster", "rehearse", "digits", "--out", str(done))
    assert again.returncode == 2 and "holds a finished rehearsal" in again.stderr and "Traceback" not in again.stderr
    bad = _scaletrain("cluster", "rehearse", "--nodes", "2", "digits", "--nnodes", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "the rehearsal sets it" in bad.stderr
    for speeds in ("fast", "1,2,3", "0"):
        bad = _scaletrain("cluster", "rehearse", "--nodes", "2", "digits", "--link-gbps", speeds)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert f"--link-gbps = {speeds!r}: expected Gbit/s above 0" in bad.stderr, bad.stderr
    none = _scaletrain("cluster")
    assert none.returncode == 2 and "fix: scaletrain cluster rehearse" in none.stderr


def test_network_namespaces_say_in_one_line_why_they_cannot_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "creating network namespaces needs root (CAP_NET_ADMIN) on Linux"
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "_capable", lambda: False)
    assert "lacks (a restricted container)" in netns.unavailable()
    monkeypatch.setattr(netns, "_capable", lambda: True)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/" + tool)
    assert netns.unavailable() is None and netns.unavailable(shaped=True) == "iproute2's 'tc' is not on PATH"


def test_the_agent_whose_worker_was_killed_is_named_not_the_one_that_lost_a_peer(tmp_path) -> None:
    """A rank killed on node 1 made node 0's worker fail too, and the rehearsal's line led with agent 0 ('worker
    rank 0 failed with exit code 1'): the agent whose worker was killed by a signal is the cause."""
    from scaletrain.cli.cluster import _first_cause

    logs = [tmp_path / "train-node0.log", tmp_path / "train-node1.log"]
    logs[0].write_text("scaletrain: worker rank 0 failed with exit code 1\n")
    logs[1].write_text("scaletrain: worker rank 1 was killed by SIGKILL (1 of 2 workers stopped with an error)\n")
    assert _first_cause([1, 1], logs) == 1
    assert _first_cause([1, 0], logs) == 0 and _first_cause([0, 0], logs) == 0
