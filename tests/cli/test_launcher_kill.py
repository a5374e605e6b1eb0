"""One machine's launcher SIGKILLed (two torchrun agents on loopback stand for two machines): its workers die
within 5 s (they ask Linux to kill them with their parent: env.die_with_launcher), the other machine's agent
exits non-zero within 60 s, and no process of the job is left anywhere."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
    kids = [int(k) for k in found]
    return kids + [g for k in kids for g in _children(k)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: it only waits for its parent to read its exit
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_killed_launcher_takes_its_workers_and_the_job_ends(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "scaletrain", "train", "digits", "--nproc", "2", "--nnodes", "2",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--dist.rdzv_id=kill-test", f"--run.dir={tmp_path / 'run'}",
           "--train.max_steps=100000", "--train.progress=false", "--train.eval_every=100000"]
    agents = []
    for i in range(2):
        agents.append(subprocess.Popen(cmd, stdout=(tmp_path / f"a{i}.log").open("w"), stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True))
        time.sleep(2)  # the first agent hosts the rendezvous: the second is the one killed
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
            time.sleep(0.5)
        time.sleep(3)  # training: every worker past its first steps
        workers = [_children(a.pid) for a in agents]
        assert all(len(w) >= 2 for w in workers), workers
        everyone = [a.pid for a in agents] + [p for w in workers for p in w]
        killed = time.monotonic()
        os.kill(agents[1].pid, signal.SIGKILL)
        while any(_alive(p) for p in workers[1]) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers[1]), "the killed launcher's workers outlived it"
        assert time.monotonic() - killed < 5
        code = agents[0].wait(timeout=60)  # the other machine notices the dead peers
        assert code != 0
        assert time.monotonic() - killed < 60
        agents[1].wait(timeout=5)
        time.sleep(1)
        assert [p for p in everyone if _alive(p)] == []
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)


PLAIN = """import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def test_a_killed_launcher_takes_a_plain_scripts_workers(tmp_path: Path) -> None:
    """A script written for plain torchrun (no scaletrain import: nothing in it asks to die with its parent) under
    `scaletrain launch`: SIGKILL of the launcher left both workers running as orphans; the launcher now asks for
    it for them, between fork and exec."""
    (tmp_path / "plain.py").write_text(PLAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "scaletrain", "launch", "--nproc", "2", str(tmp_path / "plain.py"),
                                 str(tmp_path)], stdout=(tmp_path / "launch.log").open("w"), stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.2)
            workers = [int(p.read_text()) for p in tmp_path.glob("rank*") if p.read_text()]
        assert len(workers) == 2, (tmp_path / "launch.log").read_text()
        killed = time.monotonic()
        os.kill(launcher.pid, signal.SIGKILL)
        while any(_alive(p) for p in workers) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "the killed launcher's workers outlived it"
    finally:
        launcher.wait(timeout=10)
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
