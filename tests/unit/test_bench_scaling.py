"""bench scaling's and the runs' arithmetic on made-up numbers: steady-state throughput from metrics.jsonl
records, efficiency in both modes, the overrides each run gets; and the throughput table's shape."""

from __future__ import annotations

import pytest

from scaletrain.bench import scaling, throughput
from scaletrain.errors import ConfigError
from scaletrain.observe.goodput import run_totals, steady_state


def test_steady_state_drops_the_warmup_interval():
    records = [  # intervals of 10 steps; the first is slow (warm-up)
        {"step": 10, "step_time_s": 1.0, "samples_per_s": 32.0},
        {"step": 20, "step_time_s": 0.1, "samples_per_s": 320.0},
        {"step": 30, "step_time_s": 0.2, "samples_per_s": 160.0},
        {"step": 35, "step_time_s": 0.1, "samples_per_s": 320.0},  # a short last interval
    ]
    s = steady_state(records)
    # 1 s + 2 s + 0.5 s for 320 + 320 + 160 samples
    assert s["samples_per_s"] == pytest.approx(800 / 3.5)
    assert s["step_time_s"] == pytest.approx(0.1)  # median of 0.1, 0.2, 0.1
    assert s["timed_steps"] == 25 and s["intervals"] == 3
    with pytest.raises(AssertionError):
        steady_state(records[:1])
    # A run logging every step: its first 3 steps are warm-up too, whichever intervals they fall in.
    every_step = [{"step": s, "steps": 1, "step_time_s": t, "samples_per_s": 32 / t}
                  for s, t in enumerate([2.0, 0.5, 0.2, 0.1, 0.1], start=1)]
    assert steady_state(every_step)["first_step"] == 2
    kept = steady_state(every_step, warmup_steps=3)
    assert (kept["first_step"], kept["last_step"], kept["timed_steps"]) == (4, 5, 2)
    assert kept["samples_per_s"] == pytest.approx(320.0)


def test_a_run_too_short_for_a_steady_state_still_tells_its_compile_apart():
    """3 steps logged every step, the first 18.9 s (the compile): no steady state after the warm-up's 3 steps,
    but the account put all 19.1 s in training and 0 s in 'compile + warm-up'; the later intervals' pace now
    tells the first one's excess apart."""
    records = [{"step": s, "steps": 1, "step_time_s": t, "samples_per_s": 8 / t}
               for s, t in enumerate([18.9, 0.1, 0.12], start=1)]
    window, rate, good = run_totals(records, wall_s=25.0, startup_s=4.0, phase_totals=[{"data": 0.0}], eval_s=1.0,
                                    checkpoint_s=0.0, earlier=None)
    assert window is None and rate is None
    parts = good["parts_s"]
    assert parts["warmup"] == pytest.approx(18.9 - 0.11) and parts["compute"] == pytest.approx(3 * 0.11)
    assert sum(parts.values()) == pytest.approx(25.0)


def test_weak_efficiency():
    results = [{"nproc": 1, "samples_per_s": 100.0}, {"nproc": 2, "samples_per_s": 190.0},
               {"nproc": 4, "samples_per_s": 300.0}]
    scaling.add_efficiency(results, "weak")
    assert [r["efficiency"] for r in results] == pytest.approx([1.0, 0.95, 0.75])
    assert [r["speedup"] for r in results] == pytest.approx([1.0, 1.9, 3.0])


def test_strong_efficiency_from_a_baseline_above_one():
    results = [{"nproc": 2, "samples_per_s": 200.0}, {"nproc": 4, "samples_per_s": 360.0}]
    scaling.add_efficiency(results, "strong")  # one rank estimated at 200 / 2 = 100
    assert [r["speedup"] for r in results] == pytest.approx([2.0, 3.6])
    assert [r["efficiency"] for r in results] == pytest.approx([1.0, 0.9])
    assert results[0]["baseline_nproc"] == 2


CPU = {"dist.device": "cpu"}  # CPU ranks, also on a machine with fewer GPUs than ranks


def test_strong_mode_fixes_the_global_batch():
    out = scaling.run_overrides("digits", [1, 2, 4], "strong", steps=8, warmup=4, overrides=CPU)
    assert out["train.global_batch"] == str(32 * 4)  # digits: 32 per rank x lcm(1, 2, 4)
    assert out["train.max_steps"] == "12" and out["train.log_every"] == "4"
    assert scaling.run_overrides("digits", [1, 3], "strong", 8, 4, CPU)["train.global_batch"] == "96"
    assert "train.global_batch" not in scaling.run_overrides("digits", [1, 2], "weak", 8, 4, CPU)


@pytest.mark.parametrize("mode, overrides, words", [
    ("strong", {"train.global_batch": "100"}, ["train.global_batch = 100", "32 x 2 = 64", "--train.global_batch=64"]),
    ("weak", {"train.global_batch": "64"}, ["train.global_batch = 64", "unset with --mode weak", "--mode strong"]),
    ("weak", {"train.max_steps": "5"}, ["train.max_steps = '5'", "use --steps"]),
    ("weak", {"dist.nproc": "2"}, ["dist.nproc = '2'", "use --steps, --warmup or --nproc"]),
])
def test_scaling_overrides_that_cannot_work(mode, overrides, words):
    with pytest.raises(ConfigError) as info:
        scaling.run_overrides("digits", [1, 2], mode, 8, 4, {**CPU, **overrides})
    for word in words:
        assert word in str(info.value)


def test_throughput_table_has_the_lectures_shape():
    def device(name, rates):
        return {"name": name, "rows": [{"batch_size": b, "samples_per_s": r, "peak_mem_bytes": 2**20 * b}
                                       for b, r in rates.items()]}

    columns, rows = throughput.table([device("cpu", {2: 100.0, 64: 1500.0}), device("cuda", {2: 90.0, 64: 6000.0})])
    assert columns == ["batch size", "cpu samples/s", "cuda samples/s", "cuda / cpu", "cpu peak MiB", "cuda peak MiB"]
    assert rows == [["2", "100", "90", "0.90x", "2", "2"], ["64", "1,500", "6,000", "4.00x", "64", "64"]]
    columns, rows = throughput.table([device("cpu", {4: 10.0})])
    assert columns == ["batch size", "cpu samples/s", "cpu peak MiB"] and rows == [["4", "10", "4"]]


def test_on_gpus_each_rank_needs_its_own(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as info:
        scaling.run_overrides("digits", [1, 2], "weak", 8, 4, {})
    assert "--nproc = 2: expected at most 1 ranks" in str(info.value) and "--dist.device=cpu" in str(info.value)
    scaling.run_overrides("digits", [1, 2], "weak", 8, 4, CPU)  # CPU ranks need no GPU
    scaling.run_overrides("digits", [1], "weak", 8, 4, {})
