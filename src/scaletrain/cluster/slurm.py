"""An sbatch script for a scaletrain run: one task per machine, each a torchrun agent for its GPUs.

The pattern torchtitan's and PyTorch's multi-node examples use: `srun` starts one `scaletrain train` per
machine; each is a torchrun agent (c10d rendezvous at the first machine, the job id as the rendezvous id)
that starts one worker per GPU. Preemption and time limits: `--signal=USR1@S` makes Slurm send SIGUSR1 to
the step S seconds before the end; the agent passes it to its workers, which agree on the stop, save a
checkpoint and exit 0 (train/preempt.py). The script then requeues the job when the run has no summary.json
(it stopped before its last step), and the requeued job resumes from that checkpoint in the same run
directory: no step is lost. A failed run (non-zero exit) is not requeued.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from scaletrain.errors import UserError

# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    gpus_per_node: int
    time: str
    cpus_per_task: int
    signal_s: int
    partition: str = ""
    account: str = ""
    job_name: str = "scaletrain"
    port: int = 29500  # the rendezvous's, on the first machine


def check_time(text: str) -> str:
    if not _TIME.match(text):
        raise UserError(f"--time = {text!r}: expected one of Slurm's formats MINUTES, HH:MM:SS or D-HH:MM:SS; "
                        "fix: --time 04:00:00")
    return text


def sbatch_script(job: SlurmJob, config: str, overrides: list[str], run_dir: str) -> str:
    """The script's text. ``config`` and ``overrides`` (--section.key=value) are passed to every machine's
    `scaletrain train`, after the layout this function sets (nnodes, nproc, rendezvous, run dir)."""
    q = shlex.quote
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={job.gpus_per_node}", f"--cpus-per-task={job.cpus_per_task}",
                  f"--time={job.time}", f"--signal=USR1@{job.signal_s}", "--requeue", "--open-mode=append",
                  "--output=slurm-%x-%j.out"]  # in the submit directory: Slurm opens it before the script runs
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    train = ["scaletrain", "train", q(config), f"--nproc={job.gpus_per_node}", '--nnodes="$SLURM_NNODES"',
             f'--rdzv-endpoint="$head:{job.port}"', '--dist.rdzv_id="$SLURM_JOB_ID"', f"--run.dir={q(run_dir)}",
             *(q(o) for o in overrides)]
    lines = ["#!/bin/bash",
             "# Written by `scaletrain slurm`; submit with: sbatch THIS_FILE",
             *(f"#SBATCH {d}" for d in directives),
             "set -uo pipefail",
             "# the first machine hosts the rendezvous; every machine's agent starts its GPUs' workers",
             'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"srun --kill-on-bad-exit=1 {' '.join(train)}",
             "code=$?",
             "# exit 0 without summary.json: stopped by USR1/TERM after saving a checkpoint; run again from it",
             f'if [ "$code" -eq 0 ] && [ ! -f {q(run_dir + "/summary.json")} ]; then',
             '  echo "scaletrain: stopped before the last step; requeueing job $SLURM_JOB_ID to resume"',
             '  scontrol requeue "$SLURM_JOB_ID"',
             "fi",
             'exit "$code"']
    return "\n".join(lines) + "\n"
