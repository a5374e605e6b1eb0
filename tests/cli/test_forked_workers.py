"""Workers of scaletrain's own commands forked from the launcher (cluster/forked.py): started as a new
`python -u -m scaletrain` would be, routed only where it is scaletrain's module, and training bit-identically
to new interpreters (SCALETRAIN_WORKER_START=exec)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from spawn_ranks import script_env

from scaletrain.cluster import forked

ENV = {**{k: v for k, v in script_env().items() if k != forked.START_ENV}, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_the_routing_forks_scaletrains_module_only_and_a_fork_exits_with_its_code(tmp_path):
    """Inside the launcher's patch of torchrun's process start: `-u -m scaletrain ...` (and scaletrain's other
    worker modules, forked.OWN_MODULES) is a forked Worker that ends with its own exit code and output; any other
    command, another package's module included, a real Popen."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
        SubprocessHandler,
    )

    from scaletrain.cluster.torchrun import _worker_processes

    env = {**ENV, forked.START_ENV: "auto"}
    made = {}
    with _worker_processes(fork=True):
        for name, args in (("version", ("-u", "-m", "scaletrain", "--version")),
                           ("usage", ("-u", "-m", "scaletrain", "train", "digits", "--train.max_steps=-3")),
                           ("own", ("-u", "-m", "scaletrain.cluster.rehearse_net", "--help")),
                           ("module", ("-u", "-m", "json.tool", "--help")),  # a module not ours: as torchrun runs it
                           ("other", ("-u", "-c", "import sys; print('plain'); sys.exit(3)"))):
            made[name] = SubprocessHandler(sys.executable, args, env, str(tmp_path / f"{name}.out"),
                                           str(tmp_path / f"{name}.err"), 0, None)
    codes = {name: handler.proc.wait(timeout=120) for name, handler in made.items()}
    for handler in made.values():
        handler._stdout.close()
        handler._stderr.close()
    assert isinstance(made["version"].proc, forked.Worker) and isinstance(made["usage"].proc, forked.Worker)
    assert isinstance(made["own"].proc, forked.Worker)
    assert isinstance(made["other"].proc, subprocess.Popen) and isinstance(made["module"].proc, subprocess.Popen)
    assert codes == {"version": 0, "usage": 2, "own": 0, "module": 0, "other": 3}
    assert "--mb" in (tmp_path / "own.out").read_text()  # rehearse_net's own usage, run as __main__
    assert (tmp_path / "version.out").read_text().startswith("scaletrain ")
    usage = (tmp_path / "usage.err").read_text()
    assert usage.count("\n") == 1 and "train.max_steps" in usage and "Traceback" not in usage, usage
    assert (tmp_path / "other.out").read_text() == "plain\n"


def test_a_forked_worker_starts_as_a_new_interpreter_would(tmp_path):
    """Its environment is the worker's (not the launcher's), the launcher's signal handlers are gone, its streams
    are unbuffered (-u), torch's threads come from OMP_NUM_THREADS and its generator from the default seed."""
    torch.manual_seed(123)
    torch.rand(3)
    threads = torch.get_num_threads()
    seen = tmp_path / "seen.json"
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}  # the agent's
    try:
        pid = os.fork()
        if pid == 0:
            try:
                forked._as_a_new_interpreter({"ONLY": "this", "OMP_NUM_THREADS": "1"}, None, None)
                seen.write_text(json.dumps({
                    "env": dict(os.environ), "threads": torch.get_num_threads(), "seed": torch.initial_seed(),
                    "rand": torch.rand(2).tolist(), "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                    "write_through": sys.stdout.write_through}))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
    got = json.loads(seen.read_text())
    torch.manual_seed(67280421310721)  # a fresh process's generator
    assert got["rand"] == torch.rand(2).tolist() and got["seed"] == 67280421310721
    assert got["env"] == {"ONLY": "this", "OMP_NUM_THREADS": "1"} and got["threads"] == 1
    assert got["sigterm"] and got["sigint"] and got["write_through"]


# The launcher, with a note of each worker it forked (cluster/forked.start), so the test knows which way ran.
LAUNCHER = """
import os, sys
from scaletrain.cluster import forked
from scaletrain.cli import main

started = forked.start
def start(*args, **kwargs):
    with open(os.environ["FORK_NOTES"], "a") as notes:
        notes.write("forked\\n")
    return started(*args, **kwargs)
forked.start = start
sys.exit(main(sys.argv[1:]))
"""


def _digits(tmp_path: Path, name: str, start: str) -> tuple[list[tuple[int, float]], int]:
    """(step, loss) of each step of a 2-rank digits job, and how many workers the launcher forked."""
    notes = tmp_path / f"{name}.forks"
    env = {**ENV, forked.START_ENV: start, "FORK_NOTES": str(notes)}
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, "train", "digits", "--nproc", "2",
                           "--train.max_steps=6", "--log.every=1", "--model.dropout=0.1", "--train.progress=false",
                           f"--run.dir={name}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    forks = len(notes.read_text().splitlines()) if notes.exists() else 0
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"], forks


def test_forked_workers_train_bit_identically_to_new_interpreters(tmp_path):
    """The same 2-rank job (dropout: each rank's generator matters) with forked workers (this machine has no
    CUDA device) and with new interpreters."""
    (fork_losses, forks), (exec_losses, none) = _digits(tmp_path, "forked", "auto"), _digits(tmp_path, "exec", "exec")
    assert (forks, none) == (2, 0)
    assert fork_losses == exec_losses and len(fork_losses) == 6


def test_the_doctors_self_test_ranks_are_forks_and_its_all_reduce_is_right(tmp_path):
    """`scaletrain doctor` starts its 2-rank self-test as scaletrain's own module: forks of the doctor, whose
    result (every rank's sum checked) is what it reports."""
    notes = tmp_path / "doctor.forks"
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, "doctor", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, check=False, env={**ENV, "FORK_NOTES": str(notes)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["self_test"]
    assert result["ok"] and result["world_size"] == 2 and result["result_correct_on_all_ranks"], result
    assert len(notes.read_text().splitlines()) == 2


def test_a_bad_worker_start_is_one_line():
    env = {**ENV, forked.START_ENV: "spawn"}
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "train", "digits", "--nproc", "2"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "SCALETRAIN_WORKER_START" in proc.stderr and "exec" in proc.stderr


def test_only_a_serial_launcher_forks(monkeypatch):
    """A process that may have run an OpenMP parallel region does not fork (its children would hang at their
    first one), nor one told not to; serial_launcher() keeps this process on one thread."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(forked, "_serial", False)
    try:
        assert not forked.can_fork()
        forked.serial_launcher()
        assert torch.get_num_threads() == 1 and forked.can_fork() is (not torch.cuda.is_available())
        monkeypatch.setenv(forked.START_ENV, "exec")
        assert not forked.can_fork()
        monkeypatch.delenv(forked.START_ENV)
        torch.set_num_threads(2)
        assert not forked.can_fork()
    finally:
        torch.set_num_threads(threads)
