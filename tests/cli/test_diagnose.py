"""A hung rank: the job ends within the collective timeout (plus start-up and a few seconds), every rank writes
its flight record (torch's Flight Recorder on Gloo, and its main thread's stack), and `scaletrain diagnose`
names the rank, the collective it did not reach and the line it was at instead."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from warm import SCALETRAIN_M

ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _scaletrain(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCALETRAIN_M, *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


HANG = "scaletrain train digits --nproc 2 --chaos.hang_rank=1"  # docs/multinode.md's hung rank


def test_a_hung_rank_is_named_within_the_timeout_and_diagnose_says_where(documented, capsys) -> None:
    """docs/multinode.md's hung rank as the docs tour ran it (rank 1 sleeps 60 s at the start of step 2,
    --dist.timeout_s=5): the job ends with one line naming rank 1, well before the hang would have, each rank
    leaves its flight record, and `scaletrain diagnose` names the collective rank 1 did not reach and its line."""
    from scaletrain.cli import main

    tour = documented(HANG)
    ran = tour.find(HANG)
    assert ran.proc is not None and ran.proc.returncode == 1, ran.problem or ran.note
    err = ran.proc.stderr
    assert "a collective failed during step 2" in err and "not answering: rank 1 (host" in err, err[-2000:]
    assert "--dist.timeout_s=5" in err
    assert ran.seconds < 50  # the 5 s timeout ended it, not the 60 s hang
    # the launcher adds no line of its own: it named 'worker rank 0 failed with exit code 1', the first rank to
    # exit, after the workers' line had named rank 1 as the one not answering
    assert "scaletrain: worker rank" not in err, err[-1500:]
    assert "scaletrain diagnose runs/hang says where each rank was" in err
    run = tour.workspace / "runs" / "hang"
    records = {p.name: json.loads(p.read_text()) for p in (run / "flight").glob("rank-*.json")}
    assert sorted(records) == ["rank-00000.json", "rank-00001.json"]
    assert records["rank-00000.json"]["reason"] == "its collective failed"
    assert records["rank-00001.json"]["reason"] == "asked by rank 0, whose collective failed"
    assert records["rank-00001.json"]["recorder"]["entries"]  # Gloo's collectives, recorded

    capsys.readouterr()
    assert main(["diagnose", str(run)]) == 0
    line, *details = capsys.readouterr().out.splitlines()
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
