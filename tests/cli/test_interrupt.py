"""The pieces behind Ctrl-C and the restart line, in-process and cheap (the end-to-end runs, 2 Gloo ranks
under torchrun, are in test_resume.py): what the launcher reads from torchrun's log, and the line rank 0
prints after a restart from what it knows."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from scaletrain import env, runtime
from scaletrain.cluster import torchrun
from scaletrain.train import preempt

TORCH_FAILURE = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def _record(msg: str, args: tuple) -> logging.LogRecord:
    return logging.LogRecord(torchrun._FAILURE_LOGGER, logging.ERROR, "api.py", 1, msg, args, None)


@pytest.mark.parametrize("trainer", [True, False])
def test_the_launcher_reads_torchruns_failure_line_for_the_restarted_workers(monkeypatch, trainer):
    monkeypatch.delenv(env.FAILED_WORKER_ENV, raising=False)
    monkeypatch.delenv("LOGLEVEL", raising=False)
    seen = torchrun._FailedWorker(drop=trainer)
    assert seen.filter(_record("Sending process %s closing signal %s", (11, "SIGTERM")))  # not ours: kept
    assert env.FAILED_WORKER_ENV not in os.environ
    kept = seen.filter(_record(TORCH_FAILURE, (-9, 1, 4242, "/usr/bin/python")))
    assert os.environ[env.FAILED_WORKER_ENV] == "4242 -9"  # what the restarted workers inherit
    assert kept is not trainer  # scaletrain's trainer says it in its own line; a user's script keeps torchrun's
    seen.forget()
    assert env.FAILED_WORKER_ENV not in os.environ


RT = runtime.Runtime(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"),
                     backend="gloo")


@pytest.mark.parametrize(("known", "line"), [
    ({"rank": 1, "pid": 4242, "exitcode": -9, "step": 13},
     "worker rank 1 (pid 4242) died by SIGKILL at step 13; restarting from checkpoint step 8 (restart 1 of 3)"),
    ({"rank": 1, "pid": 4242, "exitcode": 1, "step": 13},
     "worker rank 1 (pid 4242) exited with code 1 at step 13; restarting from checkpoint step 8 (restart 1 of 3)"),
    # plain torchrun: nobody passes the pid and exit code on, the survivors name the rank that never answered
    ({"missing": "1", "step": 13},
     "worker rank 1 stopped answering at step 13; restarting from checkpoint step 8 (restart 1 of 3)"),
    ({}, "a worker failed; restarting from checkpoint step 8 (restart 1 of 3)"),
])
def test_the_restart_line_says_what_is_known_and_nothing_else(monkeypatch, known, line):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setattr(runtime, "previous_failure", lambda rt: known)
    assert preempt.restart_line(RT, 8) == line
    assert preempt.restart_line(RT, None).endswith("restarting from step 0 (no checkpoint to resume) (restart 1 of 3)")
    other = runtime.Runtime(1, 1, 2, 2, torch.device("cpu"), "gloo")
    assert preempt.restart_line(other, 8) is None  # rank 0 says it, once
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # rank 0's launcher restarted for another's failure
    if known:
        assert preempt.restart_line(RT, 8) == line.replace("restart 1 of 3", "restarted by another machine's launcher")
    monkeypatch.setattr(runtime, "previous_failure", lambda rt: {})
    assert preempt.restart_line(RT, 8) is None  # a first attempt has nothing to explain


WAITS_FOR_CTRL_C = """\
import sys, time
from scaletrain.train.preempt import PreemptFlag

flag = PreemptFlag().install()
print("ready", flush=True)
while not flag.signum:
    time.sleep(0.01)
print("flag", flag.signum, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_sets_the_flag_and_a_second_one_exits_130_at_once(first):
    """After Ctrl-C, or after the SIGTERM a launcher's agent sends when another worker died: a Ctrl-C stops at
    once, and says which came first (it said 'Ctrl-C again' of the first Ctrl-C after a SIGTERM)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-c", WAITS_FOR_CTRL_C], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(first)
        assert proc.stdout.readline() == f"flag {int(first)}\n"  # set, not raised: the loop saves at its next step
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - started < 5  # not the 60 s sleep
    assert proc.returncode == 130
    said = [("scaletrain: Ctrl-C: saving a checkpoint after this step, then stopping (Ctrl-C again: stop now, "
            "without one)"),
            "scaletrain: Ctrl-C again: stopping now, without a checkpoint (the last committed one stays whole)"]
    if first == signal.SIGTERM:
        said = [("scaletrain: Ctrl-C after SIGTERM: stopping now, without a checkpoint (the last committed one "
                "stays whole)")]
    assert err.splitlines() == said


SIGNALLED_WHILE_STARTING = """\
import os, signal, time
from scaletrain.env import hold_stop_signal
hold_stop_signal()  # what `scaletrain train` does first
os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's USR1 while torch is still importing
time.sleep(0.5)
from scaletrain.train.preempt import PreemptFlag
flag = PreemptFlag().install()
print("flag", flag.signum, flush=True)
time.sleep(2.6)  # the model still building: longer than a step's grace (2 s), no step yet
flag.tick()
flag.finished()
print("the first step saves and the run exits 0", flush=True)
"""


def test_slurms_usr1_while_the_run_starts_waits_for_its_first_step():
    """SIGUSR1 before the run's handlers were installed killed the process (its default action): no checkpoint,
    no exit 0 for the batch script's requeue, the job lost. A training command now holds it from its first
    moment for the run's handler; and the watchdog, which ends a signalled process that completes no step for
    5 step times (at least 2 s), waits for the first step (2 minutes) rather than ending a run still starting."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", SIGNALLED_WHILE_STARTING], env=environ, text=True,
                          capture_output=True, timeout=60, check=False)
    assert (proc.returncode, proc.stdout.splitlines()) == \
        (0, [f"flag {int(signal.SIGUSR1)}", "the first step saves and the run exits 0"]), proc.stderr


def test_a_launcher_hands_a_usr1_it_held_or_got_before_its_workers_to_them(monkeypatch):
    """`scaletrain train --nproc N` under Slurm: a USR1 reaching the launcher while it starts, or while its agent
    waits at the rendezvous (no workers yet to pass it to), is in the environment its workers start with, and a
    worker's flag takes it from there, once."""
    monkeypatch.delenv(env.HELD_SIGNAL_ENV, raising=False)
    monkeypatch.setattr(torchrun, "_descendants", lambda pid: [])
    torchrun._forward_to_workers(signal.SIGUSR1, None)
    assert os.environ[env.HELD_SIGNAL_ENV] == str(int(signal.SIGUSR1))
    flag = preempt.PreemptFlag().install()
    try:
        assert flag.signum == signal.SIGUSR1 and env.HELD_SIGNAL_ENV not in os.environ
        assert preempt.PreemptFlag().install().uninstall() is None and env.held_signal() == 0  # once
    finally:
        flag.finished()
        flag.uninstall()


def test_a_sigterm_before_the_first_step_still_ends_the_process_in_seconds():
    """The first step's long wait is USR1's only: torchrun stopping the survivors of a worker that failed while
    starting sends SIGTERM, and a survivor still starting (no step to save) ends after the 2 s grace, not when the
    agent's SIGKILL comes 30 s later."""
    script = ("import os, signal, time\nfrom scaletrain.train.preempt import PreemptFlag\n"
              "flag = PreemptFlag().install()\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", script], env=environ, text=True, capture_output=True, timeout=60,
                          check=False)
    # 143 by the watchdog, after its own count of idle seconds (not a wall clock here: torch's import under load);
    # with the 120 s wait the script's 30 s sleep ended first, and it exited 0
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    said = re.search(r"no step completed for (\d+\.\d) s after SIGTERM: exiting without a checkpoint", proc.stderr)
    assert said is not None and 2.0 <= float(said.group(1)) < 10, proc.stderr
