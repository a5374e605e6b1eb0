"""`scaletrain train --log.grad_noise_scale`: B_simple in metrics.jsonl, the summary and its table; the same
numbers after a stop and resume as straight through, to float32 rounding (its smoothed state is in the
checkpoint); what it cannot
measure is one line and exit code 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

from warm import SCALETRAIN_M

ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
RUN = ["--nproc", "2", "--log.grad_noise_scale", "--train.max_steps=20", "--log.every=5", "--train.progress=false",
       "--train.eval_batches=1"]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCALETRAIN_M, "train", "digits", *args], capture_output=True,
                          text=True, env=ENV, timeout=300, check=False)


def _noise(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_noise_scale"] for r in rows if r["kind"] == "train" and "grad_noise_scale" in r}


def test_the_noise_scale_is_logged_summarized_and_resumed_exactly(tmp_path: Path) -> None:
    straight = _train(*RUN, f"--run.dir={tmp_path / 'a'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    logged = _noise(tmp_path / "a")
    assert sorted(logged) == [5, 10, 15, 20]
    for record in logged.values():  # 32 per rank, 64 per step on 2 ranks
        assert (record["b_small"], record["b_big"]) == (32, 64) and record["trace"] > 0
        assert math.isfinite(record["b_simple"])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())["grad_noise_scale"]
    assert summary["b_simple"] == logged[20]["b_simple"] and summary["updates"] == 4
    assert summary["global_batch"] == 64 and "doubling the world size to 4 (batch 128)" in summary["reading"]
    assert "noise scale" in straight.stdout and "B_noise" in straight.stdout
    report = subprocess.run([*SCALETRAIN_M, "report", str(tmp_path / "a")], capture_output=True,
                            text=True, env=ENV, timeout=120, check=False)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "gradient noise scale" in report.stdout and (tmp_path / "a" / "report" / "noise_scale.png").is_file()
    charts = json.loads((tmp_path / "a" / "report" / "report.json").read_text())["charts"]
    assert charts["noise_scale"]["file"] == "noise_scale.png"
    # stopped at step 10 (a checkpoint), then resumed by the same command: every estimate as straight through
    stopped = _train(*RUN, f"--run.dir={tmp_path / 'b'}", "--checkpoint.every=10", "--chaos.interrupt_step=10")
    assert stopped.returncode == 0 and "step-00000010 saved; run the same command again to resume" in stopped.stdout
    resumed = _train(*RUN, f"--run.dir={tmp_path / 'b'}", "--checkpoint.every=10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    # The weights resume bit for bit; the estimates to float32 rounding: a resumed process's first step sums its
    # bucket norms over DDP's first-iteration buckets, which the straight run had rebuilt by then.
    again = _noise(tmp_path / "b")
    assert sorted(again) == sorted(logged) and again[5] == logged[5] and again[10] == logged[10]
    for step in (15, 20):
        for key in ("b_simple", "g2", "trace"):
            assert math.isclose(again[step][key], logged[step][key], rel_tol=1e-5), (step, key)


def test_what_it_cannot_measure_is_one_line(tmp_path: Path) -> None:
    one = _train("--log.grad_noise_scale", "--train.max_steps=2", f"--run.dir={tmp_path / 'one'}")
    assert one.returncode == 2 and "Traceback" not in one.stderr
    assert "log.grad_noise_scale" in one.stderr and "fix: --nproc 2, or --train.accum_steps=2" in one.stderr
    accum = _train("--log.grad_noise_scale", "--train.accum_steps=2", "--train.max_steps=4", "--log.every=2",
                   "--train.progress=false", f"--run.dir={tmp_path / 'accum'}")
    assert accum.returncode == 0, accum.stderr[-2000:]
    assert all(r["b_small"] == 32 and r["b_big"] == 64 for r in _noise(tmp_path / "accum").values())
    tp = subprocess.run([*SCALETRAIN_M, "train", "llama-tiny", "--nproc", "2",
                         "--parallel.tp=2", "--log.grad_noise_scale", "--train.max_steps=2",
                         f"--run.dir={tmp_path / 'tp'}"], capture_output=True, text=True, env=ENV, timeout=300,
                        check=False)
    assert tp.returncode == 2 and "Traceback" not in tp.stderr, tp.stderr[-2000:]
    assert "under tensor or pipeline parallelism (tp = 2, pp = 1)" in tp.stderr
    assert len([line for line in tp.stderr.splitlines() if "log.grad_noise_scale" in line]) == 1
