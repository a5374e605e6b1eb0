"""A finished run is never overwritten: the default run directory steps past it, an explicit one is refused."""

from __future__ import annotations

import hashlib

from scaletrain.cli import main


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_rerunning_never_overwrites_a_finished_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "digits", "--train.epochs=1", "--train.progress=false"]
    assert main(argv) == 0
    first = tmp_path / "runs/digits"
    before = digest(first)
    assert set(before) == {"config.toml", "metrics.jsonl", "summary.json", "model.safetensors", ".lock"}

    assert main(argv) == 0  # the same command again: a new directory, the old one untouched
    assert (tmp_path / "runs/digits-2/summary.json").is_file()
    assert 'dir = "runs/digits-2"' in (tmp_path / "runs/digits-2/config.toml").read_text()
    assert digest(first) == before
    capsys.readouterr()

    assert main([*argv, "--run.dir=runs/digits"]) == 2  # named explicitly: refused, not overwritten
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("scaletrain: error: run.dir = 'runs/digits': expected a new or unfinished run "
                   "directory (runs/digits/summary.json says this one finished); fix: --run.dir=runs/digits-3, "
                   "or remove runs/digits first")]
    assert digest(first) == before


def test_a_second_run_on_a_directory_a_run_is_writing_is_refused_before_it_writes(tmp_path, capsys):
    """Two runs on one run.dir deleted each other's checkpoints (each one's retention) and tore metrics.jsonl; the
    second is now one line and exit 2, and the first run's files are as they were. The lock is the kernel's
    (flock), dropped when its process ends however it ends: here a child process holds it."""
    import socket
    import subprocess
    import sys
    import textwrap

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from scaletrain.train.rundir import hold_run_dir
        hold_run_dir(Path({str(run)!r}))
        print("held", flush=True)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (run / "metrics.jsonl").write_text("the first run's\n")
        assert main(["train", "digits", "--train.max_steps=2", f"--run.dir={run}", "--train.progress=false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [(f"scaletrain: error: run.dir = '{run}': expected a directory no other run is writing (pid "
                        f"{holder.pid} on {socket.gethostname()} holds {run / '.lock'}); fix: wait for that run to "
                        f"end, or --run.dir={tmp_path / 'run-2'}")]
        assert sorted(p.name for p in run.iterdir()) == [".lock", "metrics.jsonl"]
        assert (run / "metrics.jsonl").read_text() == "the first run's\n"
    finally:
        holder.communicate("\n", timeout=60)
    # its process gone, the directory is free: the same command trains (an unfinished run dir is resumed or reused)
    assert main(["train", "digits", "--train.max_steps=2", f"--run.dir={run}", "--train.progress=false"]) == 0


def test_a_file_named_checkpoints_in_the_run_dir_is_one_line_before_training(tmp_path, capsys):
    """It failed every save of the run, then ended in a FileExistsError traceback at a preemption's save."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    assert main(["train", "digits", "--train.max_steps=2", f"--run.dir={run}", "--train.progress=false"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"scaletrain: error: run.dir = '{run}': expected a run directory whose checkpoints is a directory "
        f"({run / 'checkpoints'} is a file); fix: move {run / 'checkpoints'} away, or --run.dir=PATH elsewhere")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def test_the_resume_hint_after_a_stop_names_auto_when_the_command_named_a_checkpoint():
    """A run started with --checkpoint.resume=PATH and stopped: the same command would start from PATH again
    (it did, ignoring the checkpoint the stop saved)."""
    from scaletrain.config import again

    assert again("auto") == "run the same command again to resume"
    assert again("runs/a/checkpoints/step-00000020").startswith(
        "run the same command with --checkpoint.resume=auto to resume from it")


def test_a_forked_child_does_not_keep_the_run_dir_taken(tmp_path):
    """A DataLoader worker forked while the run holds its directory shares the lock's open file: without closing
    its copy at fork, the directory stayed taken after the run let it go, for as long as the worker lived."""
    import multiprocessing
    import subprocess
    import sys

    from scaletrain.train.rundir import hold_run_dir, release_run_dir

    run = tmp_path / "run"
    run.mkdir()
    hold_run_dir(run)
    child = multiprocessing.get_context("fork").Process(target=__import__("time").sleep, args=(30,))
    child.start()
    try:
        release_run_dir(run)
        code = (f"from pathlib import Path; from scaletrain.train.rundir import hold_run_dir; "
                f"hold_run_dir(Path({str(run)!r})); print('taken')")
        taken = subprocess.run([sys.executable, "-c", code],
                               capture_output=True, text=True, timeout=60, check=False)
        assert taken.stdout.strip() == "taken", taken.stderr[-500:]
    finally:
        child.kill()
        child.join()


def test_a_finished_run_with_checkpoints_says_how_to_train_it_further_and_that_works(tmp_path, monkeypatch, capsys):
    """Asking a finished run directory for more steps (Lightning's fit(ckpt_path=...) with a larger max_steps) got
    only "another --run.dir, or remove it": the fix now names the new directory and the latest checkpoint, and
    that command goes on from the finished run's last step to the new end."""
    import json
    import shlex

    monkeypatch.chdir(tmp_path)
    argv = ["train", "digits", "--train.max_steps=6", "--checkpoint.every=3", "--train.progress=false",
            "--run.dir=runs/a"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--train.max_steps=9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("scaletrain: error: run.dir = 'runs/a': expected a new or unfinished run directory "
                    "(runs/a/summary.json says this one finished); fix: --run.dir=runs/a-2, or remove runs/a first; "
                    "to train it further, add --run.dir=runs/a-2 --checkpoint.resume=runs/a/checkpoints/step-00000006 "
                    "with a larger train.max_steps or train.epochs")]
    further = shlex.split(err[0].split("add ", 1)[1].split(" with ", 1)[0])
    assert main([*argv, "--train.max_steps=9", *further]) == 0
    out = capsys.readouterr().out
    assert "resumed from runs/a/checkpoints/step-00000006: step 6 of 9" in out
    assert json.loads((tmp_path / "runs/a-2/summary.json").read_text())["steps"] == 9
