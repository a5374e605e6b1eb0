"""Every user mistake on the command line: exit code 2 and one line naming the key, the value, what is
allowed and the fix. Never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from scaletrain.cli import main


def run_main(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()


@pytest.mark.parametrize("argv, words", [
    (["train", "digits", "--optim.lrr=0.1"], ["optim.lrr = '0.1' (command line)", "(optim.lrr is not one)", "did you mean --optim.lr?"]),
    (["train", "digits", "--train.epochs=ten"], ["train.epochs = 'ten'", "expected an integer", "fix:"]),
    (["train", "digits", "--nproc", "0"], ["dist.nproc = 0", "an integer >= 1", "fix: --nproc 2"]),
    (["train", "digits", "--nproc=2", "--train.global_batch=100"],
     ["train.global_batch = 100", "a multiple of data.batch_size x world size = 32 x 2 = 64",
      "--train.global_batch=64"]),
    (["train", "digits", "--data.batch_size=2000"], ["data.batch_size = 2000", "no larger than the 1437"]),
    (["train", "llama-tiny", "--parallel.pp=2"],  # one process: no launcher's preflight, the worker's own check
     ["parallel.pp = 2", "degrees whose product divides the world size 1", "fix: --nproc a multiple of 2"]),
    (["train", "missing.toml"], ["config = 'missing.toml' (not found)", "fix: check the path"]),
    (["train", "digitz"], ["config = 'digitz'", "use one of the recipes: digits, gpt-stdlib"]),
    (["train", "digits", "--model.name=gpt"], ["model.name = 'gpt'", "mlp or cnn"]),
    (["train", "digits", "--log.straggler_min_frac=0"],
     ["log.straggler_min_frac = 0", "a fraction of the step time > 0", "fix: --log.straggler_min_frac=0.25"]),
    (["train", "digits", "--train.precision=fp16-mixed"], ["train.precision = 'fp16-mixed'", "--train.precision=bf16-mixed"]),
    (["train", "digits", "--train.precision=bf16"], ["train.precision = 'bf16'", "one of fp32, bf16-mixed, fp16-mixed", "fix: --train.precision=bf16-mixed"]),
    (["train", "digits", "--device=cuda"], ["dist.device = 'cuda'", "without CUDA"]),
    (["train", "gpt-stdlib", "--data.source=bin"], ["data.path = ''", "train.bin and val.bin"]),
    (["report", "nowhere", "--out", "/dev/null/x"], ["--out = '/dev/null/x'", "/dev/null is not a directory",
                                                     "fix: --out reports/mine"]),  # before the run is read
    (["lab", "descent", "--out", "/dev/null/x"], ["--out = '/dev/null/x'", "/dev/null is not a directory"]),
    (["lab", "scaling-law", "--sizes", "8,16,24,32", "--out", "/dev/null/x"], ["/dev/null is not a directory"]),
    (["checkpoint", "export", "nowhere", "/dev/null/x.safetensors"],
     ["/dev/null/x.safetensors: its folder cannot be made or written (/dev/null is not a directory)"]),
    (["train"], ["the following arguments are required: RECIPE|FILE.toml", "--help"]),
    (["fly"], ["invalid choice: 'fly'"]),
])
def test_bad_input_exits_2_with_one_line(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, lines = run_main(argv, capsys)
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("scaletrain: error: ")
    for word in words:
        assert word in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing was started or written


def test_a_malformed_data_file_is_named(capsys, tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(data / "train.bin")
    (data / "val.bin").write_bytes(b"\x00\x01\x02")  # 3 bytes: not uint16
    code, lines = run_main(["train", "gpt-stdlib", "--data.source=bin", f"--data.path={data}",
                            f"--run.dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and len(lines) == 1
    assert f"{data / 'val.bin'}: size 3 bytes is odd" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "plan", "verify-resume"])
def test_a_script_given_where_a_config_goes_says_how_scripts_run(command, capsys, tmp_path, monkeypatch):
    """`scaletrain train my_script.py` read the script as TOML: 'expected valid TOML (Expected '=' after a key ...
    at line 1)'; fix: correct the file at that line'. verify-resume takes scripts: it runs them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_script.py").write_text("import scaletrain\n")
    code, lines = run_main([command, "my_script.py", "--steps", "0"] if command == "verify-resume" else
                           [command, "my_script.py"], capsys)
    if command == "verify-resume":
        assert code == 2 and "TOML" not in " ".join(lines)
        return
    said = ("scaletrain: error: config = 'my_script.py' (a Python script): expected a TOML file or a built-in "
            "recipe (a Python script is run, not read); fix: scaletrain launch --nproc 2 my_script.py (its fit() or "
            "session takes the --section.key options), or scaletrain.plan_fit() inside it to plan it")
    assert code == 2 and lines == [said]


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    from scaletrain.config import all_keys

    for key in all_keys():
        assert f"--{key} " in out, key
    assert "--nproc" in out and "--device" in out


def test_a_real_process_prints_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # a new interpreter on purpose (not tests/warm.py's fork): what a user's shell starts
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "train", "digits", "--optim.momentum=1.5"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        ("scaletrain: error: optim.momentum = 1.5 (command line): expected a number in [0, 1); "
         "fix: --optim.momentum=0.9")]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_reader_that_leaves_the_pipe_early_gets_no_traceback(tmp_path, monkeypatch):
    """`scaletrain plan ... | head -1`: once the reader has closed the pipe every write fails (EPIPE); the command
    ends with exit code 1 and no traceback (rich's tables end so by themselves, the plan's lines did not)."""

    class Closed:  # stdout whose reader left: a file descriptor to point at /dev/null, writes that fail
        def __init__(self, fd: int) -> None:
            self.fd = fd

        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            pass

        def fileno(self) -> int:
            return self.fd

        def isatty(self) -> bool:
            return False

    fd = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    monkeypatch.setattr(sys, "stdout", Closed(fd))
    try:
        assert main(["plan", "gpt-stdlib", "--gpu", "h100"]) == 1
    finally:
        os.close(fd)


def test_a_socket_interface_that_is_not_here_is_one_line_before_the_workers(capsys, tmp_path, monkeypatch):
    """GLOO_SOCKET_IFNAME naming no interface: every worker printed a traceback ('Unable to find address for')
    and the job exited 1; now one line and exit 2, nothing started."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    code, lines = run_main(["train", "digits", "--nproc", "2", "--train.max_steps=2"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("scaletrain: error: GLOO_SOCKET_IFNAME='bogus0' matches no network interface here "
                               "(there are: lo"), lines
    assert "fix: name the interface that reaches the other machines, or unset GLOO_SOCKET_IFNAME" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("env, words", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["RANK, WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not", "unset RANK WORLD_SIZE"]),
    ({"WORLD_SIZE": "2"}, ["WORLD_SIZE set but RANK, MASTER_ADDR, MASTER_PORT not", "fix: start the job with torchrun"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, ["MASTER_PORT not"]),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"},
     ["RANK='x' in the environment is not a whole number >= 0", "unset RANK"]),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"},
     ["RANK 2 is outside 0..1 (WORLD_SIZE 2)"]),
])
def test_a_launchers_variables_left_in_the_shell_are_one_line(env, words, capsys, tmp_path, monkeypatch):
    """RANK and WORLD_SIZE exported by hand (or left from another job) without the rest of what a launcher sets:
    torch's ValueError at init ('MASTER_ADDR expected'), or with WORLD_SIZE alone a run of world size 2 with no
    group ('Default process group has not been initialized'); now one line and exit 2, before anything is written."""
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, lines = run_main(["train", "digits", "--train.max_steps=1"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("scaletrain: error: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("env", [{"RANK": "0"}, {"WORLD_SIZE": "1"}, {"RANK": "0", "WORLD_SIZE": "1"},
                                 {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}])
def test_variables_that_say_one_process_run_as_one(env, capsys, tmp_path, monkeypatch):
    """RANK=0 and WORLD_SIZE=1 with no address (a notebook's or a shell's), or an address alone, are one process."""
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "digits", "--train.max_steps=1", "--train.eval_every=0", "--run.dir=r"]) == 0
    assert (tmp_path / "r" / "summary.json").is_file()
