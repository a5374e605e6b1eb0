"""The built-in recipes through the real command line, 2 DDP ranks started by torchrun on loopback."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from scaletrain.config import load
from scaletrain.data import digits
from scaletrain.models import CNN
from scaletrain.observe.goodput import PARTS, steady_state

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo"}


def scaletrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A new interpreter on purpose (not tests/warm.py's fork), as the user's shell starts it."""
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=300, check=False)


@pytest.fixture(scope="module")
def digits_run(documented):
    """`make demo` (digits on 2 ranks, the README's first command), as the docs tour ran it."""
    tour = documented("make demo")
    demo = tour.find("make demo")
    assert demo.proc is not None and demo.proc.returncode == 0, demo.problem or demo.note
    return tour.workspace / "runs" / "digits", demo.proc


def test_digits_two_ranks_reach_97_percent(digits_run):
    run_dir, proc = digits_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 64 and summary["backend"] == "gloo"
    assert summary["steps"] == 20 * (1437 // 64)
    assert summary["eval"]["count"] == 360  # every test image once, none padded
    assert summary["eval"]["accuracy"] >= 0.97
    if summary["device"] == "cpu":  # what the README says of `make demo`: 98.06%, 353 of 360, every run
        assert summary["eval"]["correct"] == 353
    for key in ("steps", "samples", "world_size", "wall_s", "train_loss", "eval", "samples_per_s", "peak_mem_bytes"):
        assert key in summary
    # rank 0 alone prints: one header, one table
    assert proc.stdout.count("effective batch 64 = 32 per rank x 2 ranks x 1 accumulation") == 1
    assert proc.stdout.count("eval  @ step 0 ") == 1 and proc.stdout.count("summary") == 1


def test_run_directory_contract(digits_run):
    run_dir, _ = digits_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert load(str(run_dir / "config.toml")).digest() == summary["config_digest"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [50, 100, 150, 200, 250, 300, 350, 400, 440]
    for r in train:
        assert {"step", "epoch", "loss", "lr", "samples_per_s", "step_time_s"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["samples_per_s"] > 0
    assert [r["step"] for r in evals] == [22 * e for e in range(21)]  # before training, then every epoch
    assert evals[-1]["eval_accuracy"] == summary["eval"]["accuracy"]


def test_the_summary_measures_steady_state_and_accounts_for_the_wall_time(digits_run):
    """samples/s (and MFU where a peak is known) over the log intervals after the first, whose compile and
    warm-up they leave out: steps 51-440 of the demo; where the wall time went, in parts that sum to it."""
    run_dir, proc = digits_run
    summary = json.loads((run_dir / "summary.json").read_text())
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert summary["steady_state"] == {"first_step": 51, "last_step": 440, "timed_steps": 390, "intervals": 8}
    assert summary["samples_per_s"] == pytest.approx(steady_state(train)["samples_per_s"], rel=1e-9)
    overall = sum(r["samples_per_s"] * r["step_time_s"] * (r["step"] - p) for r, p in
                  zip(train, [0] + [r["step"] for r in train])) / summary["train_s"]
    assert summary["samples_per_s_overall"] == pytest.approx(overall, rel=1e-6)
    good = summary["goodput"]
    parts = good["parts_s"]
    assert list(parts) == list(PARTS) and all(v >= 0 for v in parts.values())
    assert abs(sum(parts.values()) - summary["wall_s"]) <= 0.02 * summary["wall_s"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [start] = [r for r in records if r["kind"] == "start"]  # from the worker's start to its last record
    span = records[-1]["time"] - start["process_start"]
    assert abs(good["wall_s"] - span) <= 0.03 * span + 0.3, (good, span)
    assert sum(good["fraction"].values()) == pytest.approx(1.0)
    assert parts["warmup"] + parts["compute"] + parts["data_wait"] == pytest.approx(summary["train_s"], rel=1e-6)
    # the process group, the data and the model (its workers, forks of the launcher, import nothing); 21 evaluations
    assert parts["startup"] > 0 and parts["eval"] > 0
    assert "steady state, steps 51-440" in proc.stdout and "time spent on" in proc.stdout


def test_saved_weights_reproduce_the_reported_accuracy(digits_run):
    run_dir, _ = digits_run
    summary = json.loads((run_dir / "summary.json").read_text())
    model = CNN((1, 8, 8), 10, channels=32, hidden=128)
    missing, unexpected = safetensors.torch.load_model(model, str(run_dir / "model.safetensors"))
    assert not missing and not unexpected
    test = digits(0.2).eval
    model.eval()
    with torch.no_grad():
        correct = (model(test.inputs).argmax(-1) == test.targets).sum().item()
    assert correct == summary["eval"]["correct"]


def test_gpt_stdlib_eval_loss_falls(tmp_path):
    proc = scaletrain("train", "gpt-stdlib", "--nproc", "2", "--run.dir=run", "--train.max_steps=30",
                      "--train.eval_every=15", "--train.eval_batches=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    losses = [r["eval_loss"] for r in evals]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert 5.0 < losses[0] < 5.6  # untrained: near ln(256) = 5.55 (measured 5.39)
    assert losses[-1] < 0.6 * losses[0]  # measured 5.39 -> 2.99 after 30 steps of 2 x 16 x 128 bytes
    assert (tmp_path / "run/model.safetensors").stat().st_size > 0
