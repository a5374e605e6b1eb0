"""--log.trace: one Chrome/Perfetto trace of every rank's steps and phases (RUN_DIR/timeline.json)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from warm import SCALETRAIN_M

ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def test_every_rank_is_a_row_with_each_step_and_its_phases_inside_it(tmp_path: Path) -> None:
    done = subprocess.run([*SCALETRAIN_M, "train", "digits", "--nproc", "2", "--log.trace",
                           "--train.max_steps=12", "--log.every=4", "--checkpoint.every=8", "--train.progress=false",
                           "--train.eval_batches=1", f"--run.dir={tmp_path}"], capture_output=True, text=True,
                          env=ENV, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["timeline"] == str(tmp_path / "timeline.json")
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and all(name.startswith(f"rank {pid} (") for pid, name in names.items())
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        steps = {e["name"]: e for e in spans if e["pid"] == rank and e["tid"] == 0}
        assert sorted(steps, key=lambda n: int(n.split()[1])) == [f"step {i}" for i in range(1, 13)]
        phases = [e for e in spans if e["pid"] == rank and e["tid"] == 1 and e["name"] != "ckpt"]
        # DDP on 2 ranks: every step computes, waits for its last all-reduce, and steps the optimizer
        for name in ("compute", "comm", "optim", "h2d"):
            assert sum(e["name"] == name for e in phases) == 12, name
        for e in phases:  # each phase lies inside one step (to the microsecond the file is rounded to)
            assert any(s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in steps.values()), e
        starts = [steps[f"step {i}"]["ts"] for i in range(1, 13)]
        assert starts == sorted(starts)
    # the checkpoint at step 8 blocked the loop: a span between step 8 and step 9 on rank 0
    ckpt = [e for e in spans if e["pid"] == 0 and e["name"] == "ckpt"]
    assert ckpt and any(e["ts"] >= next(s["ts"] for s in spans if s["pid"] == 0 and s["name"] == "step 8") for e in ckpt)


def test_the_profiler_records_exactly_the_steps_of_its_window(tmp_path: Path) -> None:
    done = subprocess.run([*SCALETRAIN_M, "train", "digits", "--debug.profile=2-4",
                           "--train.max_steps=6", "--log.every=2", "--train.progress=false", "--train.eval_batches=1",
                           f"--run.dir={tmp_path}"], capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads((tmp_path / "profile" / "rank-00000.json").read_text())["traceEvents"]
    assert sum(str(e.get("name", "")).startswith("Optimizer.step#") for e in trace) == 3  # steps 2, 3 and 4
    table = (tmp_path / "profile" / "rank-00000.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    bad = subprocess.run([*SCALETRAIN_M, "train", "digits", "--debug.profile=5-3",
                          f"--run.dir={tmp_path / 'bad'}"], capture_output=True, text=True, env=ENV, timeout=120,
                         check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--debug.profile=10-12" in bad.stderr
