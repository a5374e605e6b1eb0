"""srun mode: `srun` starting one task per GPU, each a worker without torchrun (env.py adopt_slurm_task), and
`scaletrain slurm --launcher srun`'s script. No Slurm here: a stand-in `srun` starts SLURM_NTASKS copies of the
command with the variables Slurm gives a step's tasks; `scontrol show hostnames` says 127.0.0.1. The 2-task job
is stopped by the SIGUSR1 Slurm sends before the time limit, requeued, resumed, and logs what a 2-rank torchrun
job logs, loss for loss."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.env import _first_host, _tasks_on_node, adopt_slurm_task

SRUN = """#!/bin/bash
kill_bad=0  # srun's own options: --kill-on-bad-exit=1 (as scaletrain slurm writes) ends every task when one fails
while [[ "$1" == --* ]]; do [[ "$1" == --kill-on-bad-exit=1 ]] && kill_bad=1; shift; done
n=${SLURM_NTASKS:-1}
pids=()
for ((i = 0; i < n; i++)); do
  SLURM_STEP_ID=0 SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_STEP_NUM_TASKS=$n \\
    SLURM_STEP_TASKS_PER_NODE=$n SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
  pids+=($!)
done
code=0
for ((i = 0; i < n; i++)); do
  wait -n; c=$?
  if [ "$c" -ne 0 ] && [ "$code" -eq 0 ]; then
    code=$c
    if [ "$kill_bad" = 1 ]; then kill "${pids[@]}" 2>/dev/null; fi
  fi
done
exit $code
"""
SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; exit 0; fi
if [ "$1" = "requeue" ]; then echo "$2" >> "$REQUEUED"; exit 0; fi
exit 1
"""
RUN = ["--train.max_steps=16", "--log.every=4", "--train.progress=false", "--train.eval_batches=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("nodelist", "first"), [("gpu[07-09,12],login1", "gpu07"), ("rack[1-2]-n[01-04]", "rack1-n01"),
                                                 ("node001", "node001"), ("a,b", "a")])
def test_the_first_host_of_a_slurm_hostlist(nodelist: str, first: str) -> None:
    assert _first_host(nodelist) == first


def test_a_tasks_rank_and_world_come_from_slurm() -> None:
    assert [_tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "12345"}
    assert adopt_slurm_task(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT")} == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu07",
                                                    "MASTER_PORT": "29845"}
    # a batch script's own process (no step), a one-task step, or a process a launcher placed: left alone
    assert not adopt_slurm_task({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert not adopt_slurm_task({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert not adopt_slurm_task({**env, "RANK": "0", "WORLD_SIZE": "8"})


def test_srun_tasks_train_as_torchrun_workers_and_resume_after_the_signal(tmp_path: Path) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    assert main(["slurm", "digits", "--nodes", "1", "--gpus-per-node", "2", "--launcher", "srun", "--port",
                 str(free_port()), "--out", str(script), "--run.dir=run", *RUN, "--chaos.signal_rank=0",
                 "--chaos.signal_step=5"]) == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=2" in text and text.count("--nproc") == 1  # =1: each task a worker
    assert "scaletrain train digits --nproc=1 " in text
    env = {**os.environ, "PATH": os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node01",
           "REQUEUED": str(tmp_path / "requeued")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    first = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=240, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "requeued").read_text() == "4242\n"
    second = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=240, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from run/checkpoints/step-00000008" in second.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["world_size"] == 2 and summary["backend"] == "gloo"

    torchrun = subprocess.run([sys.executable, "-m", "scaletrain", "train", "digits", "--nproc", "2",
                               f"--run.dir={tmp_path / 'torchrun'}", *RUN], capture_output=True, text=True,
                              env={k: v for k, v in env.items() if not k.startswith("SLURM_")}, timeout=240,
                              check=False)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]

    def losses(run_dir: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
    assert losses(tmp_path / "run") == losses(tmp_path / "torchrun") and sorted(losses(tmp_path / "run")) == [4, 8, 12, 16]


@pytest.mark.parametrize("where", ["every task", "rank 1 only"])
def test_a_usage_error_in_srun_tasks_is_said_once(tmp_path: Path, where: str) -> None:
    """A bad key in an srun job of 2 tasks (srun --kill-on-bad-exit, as the script `scaletrain slurm` writes):
    each task found it before the run gave it a rank (a task becomes one after its config is read), so each said
    it, or the first to exit killed the other first: the line came 0 to N times. Rank 0 now opens the job's
    store for the count, as torchrun's agent does, says the line and waits for the others to count themselves:
    once, without a rank prefix. An error only rank 1 meets (rank 0 forming the group meanwhile) is said once,
    by rank 1, through the group's store."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(SRUN)
    (stubs / "srun").chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "SLURM_JOB_ID": "4243", "SLURM_NNODES": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(key, None)
    who = "true" if where == "every task" else '[ "$SLURM_PROCID" = 1 ]'
    command = ["srun", "--kill-on-bad-exit=1", "bash", "-c", f'if {who}; then set -- "$@" --train.max_stpes=4; fi; exec "$@"', "-",
               sys.executable, "-m", "scaletrain", "train", "digits", "--nproc=1", "--run.dir=run", *RUN]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("scaletrain:", "[rank"))]
    prefix = "" if where == "every task" else "[rank 1] "
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"{prefix}scaletrain: error: train.max_stpes"), lines
