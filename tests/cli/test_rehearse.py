"""scaletrain cluster rehearse: a 2-node job as two torchrun agents on loopback computes what one node of 4
ranks does at the same global batch (weights within 1e-6), and reports the world, the bandwidth and the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch

ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
RUN = ["--train.progress=false", "--train.eval_batches=1", "--log.every=4"]


def _scaletrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, env=ENV,
                          timeout=600, check=False)


def test_two_nodes_of_two_ranks_equal_one_node_of_four(tmp_path: Path) -> None:
    rehearsed = _scaletrain("cluster", "rehearse", "--nodes", "2", "--nproc", "2", "digits", "--steps", "4",
                            "--out", str(tmp_path / "rehearse"), *RUN)
    assert rehearsed.returncode == 0, rehearsed.stdout[-2000:] + rehearsed.stderr[-2000:]
    out = rehearsed.stdout
    assert "rehearsal: 2 nodes x 2 ranks on this machine" in out and "world 4, gloo" in out
    assert "between the nodes' first ranks" in out
    assert ("on 2 real machines, run on each: scaletrain train digits --nproc=2 --nnodes=2 "
            "--rdzv-endpoint=FIRST_MACHINE:29500 --dist.rdzv_id=JOB_ID") in out
    net = json.loads((tmp_path / "rehearse" / "net.json").read_text())
    assert net["nodes"] == 2 and sorted(r["rank"] for r in net["ranks"]) == [0, 1, 2, 3]
    assert sorted((r["node"], r["local_rank"]) for r in net["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]

    one = _scaletrain("train", "digits", "--nproc", "4", "--train.max_steps=4", f"--run.dir={tmp_path / 'one'}", *RUN)
    assert one.returncode == 0, one.stderr[-2000:]
    a = safetensors.torch.load_file(str(tmp_path / "rehearse" / "run" / "model.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "one" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    summary = json.loads((tmp_path / "rehearse" / "run" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_batch"] == 128 and summary["steps"] == 4
    assert torch.isfinite(torch.tensor(summary["train_loss"]))


def test_what_the_rehearsal_sets_cannot_be_given() -> None:
    bad = _scaletrain("cluster", "rehearse", "--nodes", "2", "digits", "--nnodes", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "the rehearsal sets it" in bad.stderr
    none = _scaletrain("cluster")
    assert none.returncode == 2 and "fix: scaletrain cluster rehearse" in none.stderr
