"""The bench commands end to end through the real CLI, on CPU with Gloo on loopback. Small and short: these
check what is measured and reported, never how fast (no timed assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warm import SCALETRAIN_M

from scaletrain.bench.units import OPS, bus_factor

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo"}
PNG = b"\x89PNG\r\n\x1a\n"


def scaletrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SCALETRAIN_M, *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=300, check=False)


def test_allreduce_on_two_ranks_checks_every_op(tmp_path):
    proc = scaletrain("bench", "allreduce", "--nproc", "2", "--sizes", "1KB..4KB", "--iters", "2", "--warmup", "1",
                      "--backend", "gloo", "--json", "ar.json", "--plot", "ar.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "ar.json").read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["device"] == "cpu"
    assert {"date", "command", "cpu", "torch", "scaletrain"} <= data["environment"].keys()
    results = data["results"]
    assert [(r["op"], r["size_bytes"]) for r in results] == [(op, s) for op in OPS for s in (1024, 2048, 4096)]
    for r in results:
        assert r["checked_iters"] == 3 and r["count"] == r["size_bytes"] // 4
        assert r["algbw_gb_per_s"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gb_per_s"] == pytest.approx(r["algbw_gb_per_s"] * bus_factor(r["op"], 2))
        assert r["time_min_s"] <= r["time_s"] <= r["time_max_s"]
    assert (tmp_path / "ar.png").read_bytes()[:8] == PNG
    assert proc.stdout.count("collectives on 2 ranks (gloo)") == 1  # rank 0 alone prints the table
    for op in OPS:
        assert proc.stdout.count(f"│ {op}") == 3


def test_throughput_on_cpu_reports_each_batch_size(tmp_path):
    temp = tmp_path / "tmp"  # the bench's TMPDIR: it leaves nothing there (each batch size's run dir was left)
    temp.mkdir()
    proc = subprocess.run([*SCALETRAIN_M, "bench", "throughput", "--recipe", "digits", "--devices", "cpu",
                           "--batch-sizes", "8,2", "--steps", "2", "--warmup", "1", "--repeats", "2", "--json", "tp.json",
                           "--plot", "tp.png"], capture_output=True, text=True, cwd=tmp_path,
                          env={**ENV, "TMPDIR": str(temp)}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(temp.iterdir()) == []
    data = json.loads((tmp_path / "tp.json").read_text())
    [cpu] = data["devices"]
    assert cpu["name"] == "cpu" and cpu["device"] == "cpu"
    assert [row["batch_size"] for row in cpu["rows"]] == [2, 8]  # ascending
    for row in cpu["rows"]:
        assert row["samples_per_step"] == row["batch_size"]
        assert len(row["samples_per_s_repeats"]) == 2 and all(r > 0 for r in row["samples_per_s_repeats"])
        assert row["samples_per_s"] > 0 and row["peak_mem_bytes"] > 0
    assert "batch size" in proc.stdout and "cpu samples/s" in proc.stdout and "cpu peak MiB" in proc.stdout
    assert "│ 2 " in proc.stdout and "│ 8 " in proc.stdout
    assert (tmp_path / "tp.png").read_bytes()[:8] == PNG


def test_throughput_of_a_sequence_model_is_in_tokens(tmp_path):
    proc = scaletrain("bench", "throughput", "--recipe", "gpt-stdlib", "--devices", "cpu", "--batch-sizes", "2",
                      "--steps", "1", "--warmup", "1", "--repeats", "1", "--model.n_layer=1", "--data.seq_len=32",
                      "--json", "tp.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads((tmp_path / "tp.json").read_text())["devices"][0]["rows"]
    assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 32)
    assert "cpu tokens/s" in proc.stdout


def test_weak_scaling_over_one_and_two_ranks(documented):
    """docs/benchmarks.md's weak-scaling command (gpt-stdlib, 1 and 2 ranks), as the docs tour ran it."""
    tour = documented("scaletrain bench scaling --recipe gpt-stdlib --nproc 1,2 --mode weak")
    ran = tour.find("scaletrain bench scaling --recipe gpt-stdlib --nproc 1,2 --mode weak")
    assert ran.proc is not None and ran.proc.returncode == 0, ran.problem or ran.note
    proc, tmp_path = ran.proc, tour.workspace
    data = json.loads((tmp_path / "weak.json").read_text())
    assert data["mode"] == "weak" and data["threads_per_rank"] == 1
    one, two = data["results"]
    assert (one["nproc"], one["global_batch"]) == (1, 16) and (two["nproc"], two["global_batch"]) == (2, 32)
    assert one["efficiency"] == pytest.approx(1.0) and two["efficiency"] > 0
    assert two["efficiency"] == pytest.approx(two["samples_per_s"] / 2 / one["samples_per_s"])
    assert one["timed_steps"] == 2 and two["backend"] == "gloo"
    for r in (one, two):  # the runs are real: their summaries are there
        assert json.loads((tmp_path / r["run_dir"] / "summary.json").read_text())["world_size"] == r["nproc"]
    if two["comm_frac"] is None:
        assert "n/a" in proc.stdout
    assert (tmp_path / "weak.png").read_bytes()[:8] == PNG
    cores = len(os.sched_getaffinity(0))
    assert ("exceed the" in proc.stdout) == (2 > cores)
