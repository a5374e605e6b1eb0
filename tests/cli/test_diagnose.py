"""A hung rank: the job ends within the collective timeout (plus start-up and a few seconds), every rank writes
its flight record (torch's Flight Recorder on Gloo, and its main thread's stack), and `scaletrain diagnose`
names the rank, the collective it did not reach and the line it was at instead."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from warm import SCALETRAIN_M

ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _scaletrain(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCALETRAIN_M, *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


def test_diagnose_names_the_hung_rank_its_collective_and_its_line(tmp_path: Path) -> None:
    started = time.monotonic()
    hung = _scaletrain("train", "digits", "--nproc", "2", f"--run.dir={tmp_path}", "--chaos.hang_rank=1",
                       "--chaos.hang_step=3", "--chaos.hang_s=120", "--dist.timeout_s=5", "--train.progress=false")
    assert hung.returncode == 1, hung.stderr[-3000:]
    assert time.monotonic() - started < 60  # the 5 s timeout ended it, not the 120 s hang
    assert f"scaletrain diagnose {tmp_path} says where each rank was" in hung.stderr
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "flight").glob("rank-*.json")}
    assert sorted(records) == ["rank-00000.json", "rank-00001.json"]
    assert records["rank-00000.json"]["reason"] == "its collective failed"
    assert records["rank-00001.json"]["reason"] == "asked by rank 0, whose collective failed"
    assert records["rank-00001.json"]["recorder"]["entries"]  # Gloo's collectives, recorded

    found = _scaletrain("diagnose", str(tmp_path))
    assert found.returncode == 0, found.stderr
    line, *details = found.stdout.splitlines()
    assert line.startswith("rank 1 (") and "did not reach collective #" in line and "on group default_pg" in line
    assert "train/chaos.py:" in line and "in before_step (time.sleep(cfg.hang_s))" in line
    assert line.endswith("; rank 0 waited in it")
    assert len(details) == 2 and details[0].lstrip().startswith("rank 0 (") and "called at" in details[0]


def test_diagnose_without_records_is_one_line(tmp_path: Path) -> None:
    found = _scaletrain("diagnose", str(tmp_path))
    assert found.returncode == 2 and "Traceback" not in found.stderr
    assert "no flight records" in found.stderr and len(found.stderr.strip().splitlines()) == 1


def test_a_rank_killed_outright_is_named_from_the_jobs_world_size(tmp_path: Path, capsys) -> None:
    """A SIGKILLed rank writes no flight record; diagnose took the ranks that did for the whole job and said
    "every rank reached the same last collective". The job's world size comes from metrics.jsonl's start
    record now, so the silent rank is named."""
    from scaletrain.cli import main

    (tmp_path / "flight").mkdir()
    record = {"rank": 0, "host": "vm", "pid": 1, "reason": "its collective failed", "stack": [],
              "recorder": {"entries": []}}
    (tmp_path / "flight" / "rank-00000.json").write_text(json.dumps(record))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "start", "step": 0, "world_size": 2}) + "\n")
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "rank(s) 1 wrote no record: dead or killed (the others' last collectives match)"
    assert out[-1].strip() == "rank 1: wrote no record (dead, or killed before it could)"
