"""`scaletrain report` end to end: two real runs (1 and 2 ranks) made with `scaletrain train`, overlaid in
one report; every bad input is exit code 2 and one line naming the path and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from warm import SCALETRAIN

from scaletrain.cli import main

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMEOUT_S = 180
STEPS = 8  # per run: a few log intervals, seconds of training


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200")
    return env


def _run(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCALETRAIN, *args], check=False, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """digits for STEPS steps on 1 rank and on 2 (global batch 32 and 64), logging every 2 steps."""
    root = tmp_path_factory.mktemp("runs")
    made = []
    for world in (1, 2):
        run_dir = root / f"w{world}"
        # The CPU on every machine, so that the numbers and labels below hold on a GPU machine too.
        proc = _run(["train", "digits", "--device=cpu", f"--nproc={world}", f"--train.max_steps={STEPS}",
                     "--train.log_every=2", "--train.eval_every=4", f"--run.dir={run_dir}"])
        assert proc.returncode == 0, _explain(proc)
        made.append(run_dir)
    return made[0], made[1]


def test_one_vs_two_ranks_overlay(runs: tuple[Path, Path], tmp_path: Path) -> None:
    w1, w2 = runs
    out = tmp_path / "cmp"
    proc = _run(["report", str(w1), str(w2), "--out", str(out)])
    assert proc.returncode == 0, _explain(proc)
    assert proc.stderr == ""
    # The table names both runs and their world sizes.
    assert "w1" in proc.stdout and "w2" in proc.stdout and "world size" in proc.stdout
    assert f"wrote {out / 'report.html'}" in proc.stdout

    manifest = json.loads((out / "report.json").read_text())
    assert manifest["summary"]["world size"] == ["1 (none, cpu)", "2 (gloo, cpu)"]
    assert manifest["summary"]["steps"][1].startswith(f"{STEPS} (")
    charts = manifest["charts"]
    # Global batch 32 vs 64: the x axis is samples, so both lines cover the same ground at the same x.
    assert charts["loss"]["data"]["w1 train"]["x"] == [s * 32 for s in range(2, STEPS + 1, 2)]
    assert charts["loss"]["data"]["w2 train"]["x"] == [s * 64 for s in range(2, STEPS + 1, 2)]
    for name in ("w1 eval", "w2 eval", "w1 eval accuracy", "w2 eval accuracy"):
        assert len(charts["loss"]["data"][name]["y"]) == 3, name  # steps 0, 4, 8
    assert set(charts["throughput"]["data"]) == {"w1", "w2", "w1 per rank", "w2 per rank"}
    for name, chart in charts.items():
        if chart["file"]:
            image = matplotlib.image.imread(out / chart["file"])
            assert image.shape[0] > 100 and image.shape[1] > 100, name

    # Per-rank keys (docs/metrics.md) appear as the trainer records them; until then the charts say so.
    w2_train = [json.loads(line) for line in (w2 / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "train"]
    if any("phase_s" in r for r in w2_train):
        assert charts["stragglers"]["data"]["w2"]["ranks"] == [0, 1]
        assert set(charts["phases"]["data"]) >= {"w2 rank 0", "w2 rank 1"}
    else:
        assert charts["stragglers"]["file"] is None and charts["stragglers"]["note"].startswith("omitted")
        assert charts["phases"]["file"] is None and "note: phases: omitted" in proc.stdout

    html = (out / "report.html").read_text()
    assert "https://" not in html and "http://" not in html and "data:image/png;base64," in html


def test_default_out_is_the_run_dir_report_folder(runs: tuple[Path, Path], tmp_path: Path) -> None:
    w1, _ = runs
    proc = _run(["report", str(w1)], cwd=tmp_path)
    assert proc.returncode == 0, _explain(proc)
    assert (w1 / "report" / "report.html").is_file() and (w1 / "report" / "loss.png").is_file()
    assert list(tmp_path.iterdir()) == []  # nothing written where the command ran


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("scaletrain: error: ") and "; fix: " in err[0] and "Traceback" not in err[0]
    return err[0]


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert f"{missing}: no such directory" in _one_line_error(["report", str(missing)], capsys)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: no metrics.jsonl here" in _one_line_error(["report", str(empty)], capsys)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"kind": "train", "step": 2, "loss": 1.5}\n{"kind": "tra\n')
    line = _one_line_error(["report", str(broken)], capsys)
    assert f"{broken / 'metrics.jsonl'} line 2: not valid JSON" in line
    assert not (broken / "report").exists()

    assert "report needs at least one RUN_DIR" in _one_line_error(["report"], capsys)
    assert "unexpected argument '--bogus'" in _one_line_error(["report", str(broken), "--bogus"], capsys)


def test_out_that_is_a_file_or_holds_foreign_files(runs: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    w1, _ = runs
    a_file = tmp_path / "report.txt"
    a_file.write_text("keep")
    assert f"{a_file}: is a file, not a directory" in _one_line_error(["report", str(w1), "--out", str(a_file)],
                                                                       capsys)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "report.html").write_text("<p>my own page</p>")
    line = _one_line_error(["report", str(w1), "--out", str(theirs)], capsys)
    assert f"{theirs / 'report.html'}: exists and was not written by scaletrain report" in line
    assert (theirs / "report.html").read_text() == "<p>my own page</p>" and a_file.read_text() == "keep"


def test_a_failed_and_a_stopped_run_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that failed left no sign of it (the report said "unfinished or running"): its last record is
    "failed" with the step and the error's line, and the report's status says it; a stopped run says where
    it stopped and that the same command resumes it."""
    from scaletrain.config import load
    from scaletrain.errors import TrainingFailed
    from scaletrain.train.run import run

    base = {"train.max_steps": 20, "log.every": 5, "train.progress": False, "train.eval_batches": 1}
    failed, stopped = tmp_path / "failed", tmp_path / "stopped"
    with pytest.raises(TrainingFailed, match="non-finite"):
        run(load("digits", {**base, "run.dir": str(failed), "chaos.nan_rank": 0, "chaos.nan_step": 7}))
    last = json.loads((failed / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "failed" and last["step"] == 10  # found at the log step that gathered it
    assert last["error"].startswith("non-finite loss on rank 0 at step 7; the step was not applied")
    assert run(load("digits", {**base, "run.dir": str(stopped), "chaos.interrupt_step": 10}))["stopped"]
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "300")  # the status in one cell, not folded
    for path, words in [(failed, "failed at step 10: non-finite loss on rank 0 at step 7"),
                        (stopped, "stopped at step 10 (chaos.interrupt_step): the same command resumes it")]:
        assert main(["report", str(path), "--out", str(tmp_path / f"report-{path.name}")]) == 0
        assert words in " ".join(capsys.readouterr().out.split()), path
    # an error that quotes a C++ file as gloo's do ('[/__w/.../unbound_buffer.cc:129] Connection closed by peer')
    # was read as rich markup: a closing tag that matches none, and report died with a traceback
    lines = (failed / "metrics.jsonl").read_text().splitlines()
    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Connection closed by peer"
    (failed / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps({**last, "error": gloo})]) + "\n")
    assert main(["report", str(failed), "--out", str(tmp_path / "report-gloo")]) == 0
    assert f"failed at step 10: {gloo}" in " ".join(capsys.readouterr().out.split())
