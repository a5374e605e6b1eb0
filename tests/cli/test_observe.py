"""Per-rank phase times through real 2-rank runs: the straggler is named with its phase, a healthy run
has none, phases add up to the step, and TensorBoard gets the same numbers. What overlap changes is counted
in tests/dist/test_overlap.py and timed by benchmarks/ddp_bucket.py --overlap both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warm import SCALETRAIN_M

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_key, None)
OWN = ("data", "h2d", "compute", "comm", "optim", "ckpt")


def train(tmp_path: Path, *args: str) -> tuple[list[dict], dict, str]:
    run_dir = tmp_path / "run"
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*SCALETRAIN_M, "train", *args, f"--run.dir={run_dir}",
                           "--train.progress=false"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], json.loads((run_dir / "summary.json").read_text()), \
        proc.stdout


DIGITS = ["digits", "--nproc", "2", "--log.every=10", "--train.eval_every=1000"]


@pytest.mark.parametrize("phase", ["data", "compute"])
def test_a_delayed_rank_is_named_with_its_phase_within_the_first_window(tmp_path, phase):
    train_records, summary, out = train(tmp_path, *DIGITS, "--train.max_steps=60", "--chaos.delay_rank=1",
                                        "--chaos.delay_ms=30", f"--chaos.delay_phase={phase}")
    flagged = [r for r in train_records if "straggler" in r]
    assert flagged and flagged[0]["step"] == 50  # the first window: 5 intervals of 10 steps
    first = flagged[0]["straggler"]
    assert (first["rank"], first["phase"]) == (1, phase)
    assert 0.020 < first["slower_by_s"] < 0.060  # the 30 ms delay, measured
    assert [s["rank"] for s in summary["stragglers"]] == [1] and summary["stragglers"][0]["phase"] == phase
    assert f"straggler: rank 1 (host {first['host']}) is" in out and f"in phase {phase}" in out
    # the straggler's own time is in its phase; the other rank waits for it in comm
    last = train_records[-1]["phase_s"]
    assert last[phase][1] - last[phase][0] > 0.020
    assert last["comm"][0] - last["comm"][1] > 0.020


def test_a_slow_loader_is_named_under_fsdp_too(tmp_path):
    """FSDP has no gradient all-reduce to mark: its first collective is the root's all-gather as forward
    starts, and the time before it (data, copy) is each rank's own."""
    train_records, summary, _ = train(tmp_path, *DIGITS, "--train.max_steps=50", "--parallel.strategy=fsdp",
                                      "--chaos.delay_rank=1", "--chaos.delay_ms=30", "--chaos.delay_phase=data")
    assert summary["strategy"] == "fsdp"
    flagged = [r for r in train_records if "straggler" in r]
    assert flagged and flagged[0]["step"] == 50
    assert (flagged[0]["straggler"]["rank"], flagged[0]["straggler"]["phase"]) == (1, "data")
    assert 0.020 < flagged[0]["straggler"]["slower_by_s"] < 0.060
    last = train_records[-1]["phase_s"]
    assert last["pre_comm"][1] - last["pre_comm"][0] > 0.020  # rank 0 waits after its mark, not before it
    assert last["pre_comm"][0] < 0.5 * last["step"][0]
    # plan vs actual (plan/actual.py): the planner's model state per rank under FSDP against rank 0's shards
    planned = summary["plan_vs_actual"]
    assert planned["layout"] == {"strategy": "fsdp", "checkpointing": "none", "world_size": 2, "tp": 1, "pp": 1,
                                 "batch_size": 32, "accum_steps": 1, "precision": "fp32"}
    assert abs(planned["error"]["model_state"]) < 0.15, planned
    assert planned["actual"]["model_state_bytes"] == sum(summary["mem"][k] for k in ("params_bytes", "grads_bytes",
                                                                                     "optim_bytes"))


def test_a_healthy_run_has_no_straggler_and_its_phases_add_up_to_the_step(documented):
    """`make demo` (digits, 2 ranks, 440 steps), as the docs tour ran it."""
    tour = documented("make demo")
    demo = tour.find("make demo")
    assert demo.proc is not None and demo.proc.returncode == 0, demo.problem or demo.note
    run_dir = tour.workspace / "runs" / "digits"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records, summary = [r for r in records if r["kind"] == "train"], json.loads((run_dir / "summary.json").read_text())
    assert len(train_records) == 9
    assert not any("straggler" in r for r in train_records) and summary["stragglers"] == []
    for record in train_records:
        phases = record["phase_s"]
        for rank in range(2):
            total = sum(phases[p][rank] for p in OWN)
            assert abs(total - phases["step"][rank]) <= 0.05 * phases["step"][rank], (record["step"], rank)
            assert phases["pre_comm"][rank] <= phases["step"][rank]
        stats = record["phase_stats"]["compute"]
        assert stats["min"] <= stats["median"] <= stats["max"] and stats["slowest_rank"] in (0, 1)
    assert set(summary["phase_frac"]) == set(OWN)
    assert summary["bottleneck"]["verdict"] in ("input-bound", "compute-bound", "communication-bound", "host-bound")
    assert summary["bottleneck"]["fix"]
    planned = summary["plan_vs_actual"]  # DDP: every rank holds the whole model state, as planned
    assert planned["layout"]["strategy"] == "ddp" and abs(planned["error"]["model_state"]) < 0.15, planned
    assert planned["accelerator"] is None and "step_time" not in planned["error"]  # no peak FLOP/s on a CPU


def test_tensorboard_gets_the_same_numbers_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_records, _, _ = train(tmp_path, "digits", "--train.max_steps=20", "--log.every=5",
                                "--log.tensorboard=true")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "phase/compute_s", "mem/peak_bytes",
            "eval/loss", "eval/accuracy"} <= tags
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train_records]
