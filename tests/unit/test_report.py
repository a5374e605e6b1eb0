"""scaletrain report from a real run directory: the charts draw the run's own numbers, the straggler
heatmap finds a known slow rank, overlays name every run, and missing keys or bad files are handled.

One real run (digits, world size 1, 12 steps) is made once per session. The per-rank keys that the trainer
does not write yet (phase_s, mem, straggler, ...) are added to a copy of its metrics.jsonl, shaped exactly
as docs/metrics.md says, for a pretend world of 4 ranks whose rank 2 waits 30 ms on data every step.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import torch

import scaletrain
from scaletrain.errors import DataError
from scaletrain.observe.report import write_report
from scaletrain.observe.report.charts import straggler_matrix
from scaletrain.observe.report.load import Run, load_run, run_names
from scaletrain.observe.report.lr import MAX_POINTS, planned_lr
from scaletrain.schedule import WarmupDecay
from scaletrain.train.lr import build_scheduler

SLOW_RANK, WORLD, DELAY_S = 2, 4, 0.030
PHASES = ("data", "h2d", "compute", "comm", "optim", "ckpt", "step", "pre_comm")


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "digits-w1"
    scaletrain.run(scaletrain.load("digits", overrides={
        "train.max_steps": 12, "train.log_every": 2, "train.eval_every": 6, "train.progress": False,
        "dist.device": "cpu",
        "run.dir": str(run_dir)}))
    return run_dir


@pytest.fixture(scope="session")
def unphased_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run with phase timing off (log.phase_times=false): no phase_s in its records."""
    run_dir = tmp_path_factory.mktemp("report") / "digits-w1"
    scaletrain.run(scaletrain.load("digits", overrides={
        "train.max_steps": 12, "log.every": 2, "train.eval_every": 6, "train.progress": False,
        "dist.device": "cpu", "log.phase_times": False, "run.dir": str(run_dir)}))
    return run_dir


# 5 steps of warmup from 0.1 x the peak, then a cosine to 0.1 x the peak, logged every 10 steps: the log
# alone never sees the warmup. digits scales its lr 0.05 tuned at a global batch of 64 down to 32 on one rank.
WARMUP = {"train.max_steps": 40, "log.every": 10, "schedule.warmup_steps": 5, "schedule.warmup_start": 0.1,
          "schedule.decay": "cosine", "schedule.min_lr_ratio": 0.1, "train.progress": False,
          "dist.device": "cpu", "debug.trace": True}
WARMUP_PEAK = 0.05 * 32 / 64


@pytest.fixture(scope="session")
def warmup_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "digits-warmup"
    scaletrain.run(scaletrain.load("digits", overrides={**WARMUP, "run.dir": str(run_dir)}))
    return run_dir


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _phases(rng: random.Random, world: int, slow: int | None) -> dict[str, list[float]]:
    """One interval's per-rank phase times (s/step): DDP makes every rank's step equally long, because the
    fast ranks wait in the all-reduce (comm) for the slow one; pre_comm is what tells them apart."""
    data = [0.002 + rng.uniform(0, 2e-4) + (DELAY_S if r == slow else 0.0) for r in range(world)]
    h2d = [0.0005] * world
    compute = [0.020 + rng.uniform(0, 1e-3) for _ in range(world)]
    pre = [d + h + c for d, h, c in zip(data, h2d, compute)]
    comm = [max(pre) - p + 0.001 for p in pre]
    optim = [0.003] * world
    step = [p + c + o for p, c, o in zip(pre, comm, optim)]
    return {"data": data, "h2d": h2d, "compute": compute, "comm": comm, "optim": optim, "ckpt": [0.0] * world,
            "step": step, "pre_comm": pre}


def add_phase_keys(src: Path, dst: Path, *, world: int = WORLD, slow: int | None = SLOW_RANK) -> Path:
    """A copy of run `src` with the per-rank keys of docs/metrics.md added to every train record."""
    shutil.copytree(src, dst)
    rng = random.Random(0)
    lines = []
    for i, rec in enumerate(_records(src)):
        if rec["kind"] == "train":
            phase_s = _phases(rng, world, slow)
            rec["phase_s"] = phase_s
            rec["phase_stats"] = {p: {"min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v),
                                      "slowest_rank": v.index(max(v))} for p, v in phase_s.items()}
            rank_peak = [300 * 2**20 + r * 2**20 + i * 2**18 for r in range(world)]
            rec["mem"] = {"peak_bytes": max(rank_peak), "rank_peak_bytes": rank_peak, "params_bytes": 605224,
                          "grads_bytes": 605224, "optim_bytes": 605224}
            rec["samples_per_s_per_rank"] = rec["samples_per_s"] / world
            if slow is not None and rec["step"] >= 4:  # the trainer's window needs a few intervals to flag
                rec["straggler"] = {"rank": slow, "host": "node0", "phase": "data", "slower_by_s": DELAY_S,
                                    "slower_by_frac": 1.1, "z": 9.5}
        lines.append(json.dumps(rec))
    (dst / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = json.loads((src / "summary.json").read_text())
    summary.update(world_size=world, phase_frac={"data": 0.2, "compute": 0.5, "comm": 0.2, "optim": 0.1},
                   bottleneck={"verdict": "input-bound", "evidence": "data 20% of step on rank 2",
                               "fix": "more loader workers"},
                   stragglers=[{"rank": slow, "host": "node0", "phase": "data", "slower_by_s": DELAY_S,
                                "slower_by_frac": 1.1, "z": 9.5, "intervals": 5}] if slow is not None else [])
    (dst / "summary.json").write_text(json.dumps(summary))
    return dst


@pytest.fixture(scope="session")
def phased_run(real_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_phase_keys(real_run, tmp_path_factory.mktemp("report") / "digits-w4")


def _decodes(path: Path) -> tuple[int, int]:
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape
    assert image.std() > 0.01  # not a blank canvas
    return image.shape[0], image.shape[1]


def test_a_real_one_rank_run_draws_every_chart_it_has_data_for(real_run: Path, tmp_path: Path) -> None:
    report = write_report([real_run], tmp_path / "out")
    drawn = {c.name for c in report.charts if c.figure is not None}
    assert drawn == {"loss", "lr", "throughput", "phases", "memory"}
    assert report.chart("stragglers").note == "omitted: one rank only: nothing to compare"
    assert not (tmp_path / "out" / "stragglers.png").exists()
    for name in drawn:
        _decodes(tmp_path / "out" / f"{name}.png")

    records = _records(real_run)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    loss = report.chart("loss").data
    assert loss["digits-w1 train"] == {"x": [r["step"] for r in train], "y": [r["loss"] for r in train]}
    assert loss["digits-w1 eval"]["y"] == [r["eval_loss"] for r in evals]
    assert loss["digits-w1 eval accuracy"]["y"] == [r["eval_accuracy"] for r in evals]
    assert report.chart("lr").data["digits-w1 logged"]["y"] == [r["lr"] for r in train]
    assert report.chart("lr").data["digits-w1 schedule"]["x"] == list(range(13))
    assert report.chart("throughput").data["digits-w1"]["y"] == [r["samples_per_s"] for r in train]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert all(set(r["phase_s"]) == set(PHASES) and len(r["phase_s"]["step"]) == 1 for r in train)

    rows = dict(report.rows)
    summary = json.loads((real_run / "summary.json").read_text())
    assert rows["steps"] == ["12 (0.27 epochs)"]
    assert rows["eval accuracy"] == [f"{100 * summary['eval']['accuracy']:.2f}%"]
    assert rows["stragglers"] == ["none flagged"]
    assert rows["bottleneck"][0].startswith(summary["bottleneck"]["verdict"] + ":")


def test_phase_keys_give_phase_straggler_and_memory_charts(phased_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = write_report([phased_run], out)
    assert all(c.figure is not None and not c.note for c in report.charts), [(c.name, c.note) for c in report.charts]
    sizes = {c.name: _decodes(out / f"{c.name}.png") for c in report.charts}
    assert sizes["stragglers"][0] > 100

    heat = report.chart("stragglers").data["digits-w4"]
    assert heat["phase"] == "pre_comm" and heat["ranks"] == [0, 1, 2, 3]
    assert heat["slowest_rank"] == SLOW_RANK
    assert heat["steps"] == [2, 4, 6, 8, 10, 12]
    # 30 ms on top of ~22.5 ms: rank 2 is > 100% slower than the median rank in every interval.
    assert all(v > 1.0 for v in heat["relative"][SLOW_RANK])
    assert all(abs(v) < 0.1 for r in (0, 1, 3) for v in heat["relative"][r])
    assert heat["flagged"] == [[s, SLOW_RANK] for s in (4, 6, 8, 10, 12)]

    phases = report.chart("phases").data
    assert set(phases) == {f"digits-w4 rank {r}" for r in range(WORLD)}
    slow, fast = phases[f"digits-w4 rank {SLOW_RANK}"], phases["digits-w4 rank 0"]
    assert slow["data"] > fast["data"] + 0.025 and fast["comm"] > slow["comm"] + 0.025  # the others wait
    assert slow["step"] == pytest.approx(fast["step"], rel=0.05)

    mem = report.chart("memory").data
    train = [r for r in _records(phased_run) if r["kind"] == "train"]
    assert mem["digits-w4 peak (max over ranks)"]["y"] == [r["mem"]["peak_bytes"] / 2**20 for r in train]
    assert mem["digits-w4 rank 3"]["y"] == [r["mem"]["rank_peak_bytes"][3] / 2**20 for r in train]

    rows = dict(report.rows)
    assert rows["stragglers"] == ["rank 2 (node0): data slower by 0.030 s (+110%), 5 intervals"]
    assert rows["bottleneck"] == ["input-bound: data 20% of step on rank 2"]
    assert rows["phase shares"] == ["compute 50%, data 20%, comm 20%, optim 10%"]


def test_no_straggler_means_a_flat_heatmap(real_run: Path, tmp_path: Path) -> None:
    run = load_run(add_phase_keys(real_run, tmp_path / "even", slow=None))
    heat = straggler_matrix(run)
    assert heat is not None and heat["flagged"] == []
    assert max(abs(v) for row in heat["relative"] for v in row) < 0.1


def test_html_is_self_contained(phased_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_report([phased_run], out)
    html = (out / "report.html").read_text()
    assert html.count("src='data:image/png;base64,") == 6
    for external in ("http://", "https://", "<script", "<link", "src='/", "src=\"http"):
        assert external not in html, external
    assert "digits-w4" in html and "rank 2 (node0)" in html
    manifest = json.loads((out / "report.json").read_text())
    assert sorted(manifest["files"]) == sorted(["report.html", "report.json", "loss.png", "lr.png",
                                                "throughput.png", "phases.png", "stragglers.png", "memory.png"])
    assert manifest["charts"]["stragglers"]["data"]["digits-w4"]["slowest_rank"] == SLOW_RANK


def test_overlay_names_each_run_and_keeps_partial_charts(unphased_run: Path, phased_run: Path,
                                                         tmp_path: Path) -> None:
    assert not any("phase_s" in r for r in _records(unphased_run))
    report = write_report([unphased_run, phased_run], tmp_path / "cmp")
    loss = report.chart("loss").data
    assert {"digits-w1 train", "digits-w4 train", "digits-w1 eval", "digits-w4 eval"} <= set(loss)
    assert [r.name for r in report.runs] == ["digits-w1", "digits-w4"]
    # Phase times exist for one of the two runs: drawn for it, and the other one named in a note.
    phases = report.chart("phases")
    assert phases.figure is not None and phases.note == "digits-w1: no phase_s in metrics.jsonl"
    assert all(label.startswith("digits-w4") for label in phases.data)
    assert report.chart("stragglers").note == "digits-w1: fewer than 2 ranks or no phase_s"
    # Same global batch in both summaries (the copy keeps it): the x axis stays in steps.
    assert loss["digits-w1 train"]["x"] == [2, 4, 6, 8, 10, 12]
    assert dict(report.rows)["world size"] == ["1 (none, cpu)", "4 (none, cpu)"]
    _decodes(tmp_path / "cmp" / "loss.png")


def test_overlay_of_different_global_batches_uses_samples(real_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "b64"
    shutil.copytree(real_run, other)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "global_batch": 64}))
    loss = write_report([real_run, other], tmp_path / "cmp").chart("loss").data
    assert loss["digits-w1 train"]["x"] == [2 * 32, 4 * 32, 6 * 32, 8 * 32, 10 * 32, 12 * 32]
    assert loss["b64 train"]["x"] == [2 * 64, 4 * 64, 6 * 64, 8 * 64, 10 * 64, 12 * 64]


def test_never_overwrites_a_file_it_did_not_write(real_run: Path, phased_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "loss.png").write_bytes(b"someone else's picture")
    with pytest.raises(DataError, match="loss.png: exists and was not written by scaletrain report"):
        write_report([real_run], out)
    assert (out / "loss.png").read_bytes() == b"someone else's picture"
    assert not (out / "report.html").exists()


def test_rewriting_a_report_replaces_its_own_files_and_drops_stale_ones(unphased_run: Path, phased_run: Path,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_report([phased_run], out)
    (out / "notes.txt").write_text("mine")
    assert (out / "phases.png").exists()
    write_report([unphased_run], out)  # no phase times: its phases.png would be a stale picture of another run
    assert not (out / "phases.png").exists() and (out / "loss.png").exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_default_out_is_inside_the_first_run(real_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "r"
    shutil.copytree(real_run, run)
    report = write_report([run])
    assert report.out == run / "report" and (run / "report" / "report.html").is_file()
    assert (run / "metrics.jsonl").read_bytes() == (real_run / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize(("content", "message"), [
    ('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "lo', "line 2: not valid JSON"),
    ('[1, 2]\n', "line 1: a JSON list, not an object"),
    ('{"kind": 3, "step": 1}\n', "line 1: kind is 3, expected a string"),
    ('{"kind": "train", "loss": 2.0}\n', "line 1: a train record without an integer 'step'"),
    ('{"kind": "train", "step": 1, "loss": "high"}\n', "line 1: loss is 'high', not a number"),
    ('{"kind": "train", "step": 1, "phase_s": {"data": [0.1, 0.2], "step": [0.3]}}\n',
     "line 1: phase_s lists have different lengths [1, 2]"),
    ('\n', "holds no train or eval records"),
])
def test_malformed_metrics_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        load_run(tmp_path)
    text = str(err.value)
    assert "\n" not in text and str(tmp_path / "metrics.jsonl") in text and "; fix: " in text


def test_a_kind_added_later_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 2, "loss": 1.5, "lr": 0.1}\n'
                                            '{"kind": "profile", "trace": "t.json"}\n')
    run = load_run(tmp_path)
    assert [r["step"] for r in run.train] == [2] and run.other == [{"kind": "profile", "trace": "t.json"}]


def test_missing_and_wrong_paths(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such directory; fix: "):
        load_run(tmp_path / "absent")
    with pytest.raises(DataError, match="no metrics.jsonl here"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "eval_loss": 1.0}\n')
    with pytest.raises(DataError, match=f"is a file, not a run directory; fix: pass its directory, {tmp_path}$"):
        load_run(tmp_path / "metrics.jsonl")
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(DataError, match="summary.json: not valid JSON"):
        load_run(tmp_path)


def test_run_names_tell_same_named_directories_apart(tmp_path: Path) -> None:
    assert run_names([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
    assert run_names([tmp_path / "x", tmp_path / "y"]) == ["x", "y"]
    assert run_names([tmp_path / "x", tmp_path / "x"]) == ["x", "x (2)"]


def _trainers_schedule(total: int) -> list[float]:
    """The lr after 0, 1, ..., total steps of the LambdaLR the trainer builds (train/job.py) for WARMUP."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=WARMUP_PEAK)
    scheduler = build_scheduler(optimizer, scaletrain.load("digits", overrides=WARMUP).schedule, total)
    lrs = []
    for _ in range(total + 1):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


def test_the_lr_chart_draws_the_schedule_of_every_step_under_the_logged_points(warmup_run: Path,
                                                                                tmp_path: Path) -> None:
    chart = write_report([warmup_run], tmp_path / "out").chart("lr")
    assert chart.figure is not None and chart.note == ""
    summary = json.loads((warmup_run / "summary.json").read_text())
    assert summary["peak_lr"] == pytest.approx(WARMUP_PEAK, rel=1e-12) and summary["steps"] == 40
    curve, logged = chart.data["digits-warmup schedule"], chart.data["digits-warmup logged"]
    expected = _trainers_schedule(40)
    assert curve["x"] == list(range(41)) and len(curve["y"]) == len(expected)
    assert max(abs(a - b) for a, b in zip(curve["y"], expected)) <= 1e-12
    # The warmup, step by step: 0.1 x peak at step 0, rising linearly to the peak at step 5.
    warmup = [WARMUP_PEAK * (0.1 + 0.9 * s / 5) for s in range(6)]
    assert curve["y"][:6] == pytest.approx(warmup, rel=1e-12, abs=0)
    assert all(a < b for a, b in zip(curve["y"][:5], curve["y"][1:6]))
    # What the trainer's optimizer ran at in each step (debug.trace): step k ran at the lr after k - 1 steps.
    traced = [json.loads(line) for line in (warmup_run / "trace" / "rank-00000.jsonl").read_text().splitlines()]
    ran = [r for r in traced if "event" not in r]  # the steps, without the run's "start" record
    assert [r["step"] for r in ran] == list(range(1, 41))
    assert max(abs(r["lr"] - curve["y"][r["step"] - 1]) for r in ran) <= 1e-12
    # The logged points, the measurement, are drawn too, and sit on the line.
    train = [r for r in _records(warmup_run) if r["kind"] == "train"]
    assert logged == {"x": [10, 20, 30, 40], "y": [r["lr"] for r in train]}
    assert all(abs(curve["y"][int(x)] - y) <= 1e-12 for x, y in zip(logged["x"], logged["y"]))


def _without_config(run: Path) -> str:
    (run / "config.toml").unlink()
    return "no config.toml"


def _unfinished(run: Path) -> str:
    (run / "summary.json").unlink()
    return "no summary.json: the run has not finished"


def _other_plan(run: Path) -> str:
    records = _records(run)
    first = next(r for r in records if r["kind"] == "train")
    first["lr"] *= 2  # as if this part of the run had twice the global batch under the linear scaling rule
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return f"the lr logged at step {first['step']} ({first['lr']:.6g}) is not the schedule's"


@pytest.mark.parametrize("damage", [_without_config, _unfinished, _other_plan])
def test_without_a_schedule_to_rebuild_the_chart_joins_the_logged_points_and_says_so(
        damage: Any, warmup_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "old"
    shutil.copytree(warmup_run, run)
    why = damage(run)
    chart = write_report([run], tmp_path / "out").chart("lr")
    assert chart.figure is not None and set(chart.data) == {"old"}
    train = [r for r in _records(run) if r["kind"] == "train"]
    assert chart.data["old"] == {"x": [10, 20, 30, 40], "y": [r["lr"] for r in train]}
    assert chart.note.startswith(f"old: the schedule is not redrawn ({why}")
    assert chart.note.endswith("; the line joins the logged points")


def test_a_long_schedule_is_exact_at_its_ends_in_a_bounded_number_of_points(tmp_path: Path) -> None:
    schedule = {"warmup_steps": 300, "decay": "step", "step_every": 2500, "gamma": 0.5}
    run = Run(tmp_path, "long", summary={"peak_lr": 0.4, "steps": 100_000}, config={"schedule": schedule})
    steps, lrs, why = planned_lr(run)
    assert why == "" and steps[0] == 0 and steps[-1] == 100_000 and len(steps) <= MAX_POINTS + 1
    cfg = scaletrain.load(None, {f"schedule.{k}": v for k, v in schedule.items()})
    factor = WarmupDecay(cfg.schedule, 100_000)
    assert lrs == [0.4 * factor(s) for s in steps]


def test_the_report_imports_nothing_from_train() -> None:
    # DESIGN.md: observe/ is a measuring layer under train/; the LR chart's schedule is scaletrain.schedule's.
    code = "import sys, scaletrain.observe.report; print([m for m in sys.modules if m.startswith('scaletrain.train')])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
