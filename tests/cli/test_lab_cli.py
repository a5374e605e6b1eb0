"""`scaletrain lab descent|scaling-law` and `scaletrain report LABDIR` end to end, as a user runs them: exit 0
and the files written; a bad flag or a bad run directory is exit code 2 and one line, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warm import SCALETRAIN

BIN = Path(sys.executable).parent
TIMEOUT_S = 120


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run([*SCALETRAIN, *args], check=False, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def _one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    assert proc.returncode == 2, _explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, _explain(proc)
    assert lines[0].startswith("scaletrain: error: ") and "fix: " in lines[0], lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def descent_lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The descent lab at its defaults, with its default output directory, from a fresh directory."""
    cwd = tmp_path_factory.mktemp("descent")
    proc = _run(["lab", "descent"], cwd)
    assert proc.returncode == 0, _explain(proc)
    assert proc.stdout.rstrip().endswith("wrote runs/lab-descent/lab.json and 3 PNGs in runs/lab-descent")
    return cwd / "runs" / "lab-descent"


def _runs(root: Path, widths: list[int]) -> list[Path]:
    """Finished runs as `scaletrain train` leaves them (summary.json), on a known law: 5 n^-0.3 + 1.5."""
    made = []
    for n in widths:
        run = root / f"w{n}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"params": n, "samples": 3200, "train_loss": 3.0,
                                                      "eval": {"loss": 5 * n ** -0.3 + 1.5}}))
        made.append(run)
    return made


def test_descent_writes_its_record_and_figures_and_reads_them_out(descent_lab: Path) -> None:
    record = json.loads((descent_lab / "lab.json").read_text())
    assert record["lab"] == "descent"
    assert record["environment"]["command"].startswith("scaletrain lab descent")
    for name in ("loss_vs_steps.png", "loss_vs_samples.png", "paths.png"):
        assert (descent_lab / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gd, mb, sgd = record["numbers"]["methods"]
    assert sgd["samples_to_target"] < mb["samples_to_target"] < gd["samples_to_target"]
    assert sgd["steps_to_target"] > max(gd["steps_to_target"], mb["steps_to_target"])


def test_report_shows_a_lab(descent_lab: Path) -> None:
    proc = _run(["report", str(descent_lab)], descent_lab.parent)
    assert proc.returncode == 0, _explain(proc)
    assert "scaletrain report: lab descent" in proc.stdout and "target loss" in proc.stdout
    page = (descent_lab / "report" / "report.html").read_text()
    record = json.loads((descent_lab / "lab.json").read_text())
    assert page.count("data:image/png;base64,") == 3
    assert "Samples to the target" in page and "GD (batch 256): to target" in page
    assert all(str(value) in page for _, value in record["rows"][:2])
    again = _run(["report", str(descent_lab)], descent_lab.parent)  # its own files: rewritten, not refused
    assert again.returncode == 0, _explain(again)


def test_report_takes_a_lab_alone(descent_lab: Path, tmp_path: Path) -> None:
    other = _runs(tmp_path, [1000])[0]
    proc = _run(["report", str(descent_lab), str(other)], tmp_path)
    _one_line_error(proc, "a lab directory is reported alone")


@pytest.mark.parametrize("argv, words", [
    (["lab", "descent", "--lr", "-1"], ["--lr = '-1'"]),
    (["lab", "descent", "--batch", "many"], ["--batch = 'many'"]),
    (["lab", "descent", "--target", "0"], ["--target = '0'"]),
    (["lab", "descent", "--lrr", "0.1"], ["unexpected argument '--lrr'"]),
    (["lab"], ["scaletrain lab needs a lab"]),
    (["lab", "scaling-law"], ["needs run directories or --sizes"]),
    (["lab", "scaling-law", "--sizes", "8,16,24,32", "--x", "tokens"], ["--x = 'tokens' with --sizes"]),
])
def test_bad_input_is_exit_2_and_one_line(argv: list[str], words: list[str], tmp_path: Path) -> None:
    _one_line_error(_run(argv, tmp_path), *words)
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_scaling_law_on_run_directories_and_its_report(tmp_path: Path) -> None:
    runs = _runs(tmp_path, [2_000, 8_000, 30_000, 120_000, 500_000])
    out = tmp_path / "law"
    proc = _run(["lab", "scaling-law", *map(str, runs), "--out", str(out)], tmp_path)
    assert proc.returncode == 0, _explain(proc)
    assert proc.stdout.rstrip().endswith(f"wrote {out / 'lab.json'} and scaling_law.png in {out}")
    fit = json.loads((out / "lab.json").read_text())["numbers"]["fit"]
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((5.0, 0.3, 1.5), rel=1e-4)
    assert "Predicted loss at 5,000,000 params" in proc.stdout
    report = _run(["report", str(out)], tmp_path)
    assert report.returncode == 0, _explain(report)
    assert "b (95%)" in report.stdout and (out / "report" / "report.html").is_file()


def test_scaling_law_names_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    runs = _runs(tmp_path, [2_000, 8_000, 30_000])
    (tmp_path / "notes").mkdir()
    line = _one_line_error(_run(["lab", "scaling-law", *map(str, runs), str(tmp_path / "notes")], tmp_path),
                           "not a finished run (no summary.json)")
    assert str(tmp_path / "notes") in line
    proc = _run(["lab", "scaling-law", *map(str, runs)], tmp_path)
    _one_line_error(proc, "at least 4 runs", "got 3 run(s)")


def test_scaling_law_sizes_train_tiny_runs(tmp_path: Path) -> None:
    proc = _run(["lab", "scaling-law", "--sizes", "4,6,8,10", "--steps", "2", "--out", "law"], tmp_path)
    assert proc.returncode == 0, _explain(proc)
    assert proc.stdout.count("trained in") == 4
    assert sorted(p.name for p in (tmp_path / "law").glob("w*")) == ["w10-s2", "w4-s2", "w6-s2", "w8-s2"]
