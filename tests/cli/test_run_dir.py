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
    assert set(before) == {"config.toml", "metrics.jsonl", "summary.json", "model.safetensors"}

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
