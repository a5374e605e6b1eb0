"""An sbatch script for a scaletrain run: one task per machine, each a torchrun agent for its GPUs.

The pattern torchtitan's and PyTorch's multi-node examples use: `srun` starts one `scaletrain train` per
machine; each is a torchrun agent (c10d rendezvous at the first machine, the job id as the rendezvous id)
that starts one worker per GPU. Preemption and time limits: `--signal=USR1@S` makes Slurm send SIGUSR1 to
the step S seconds before the end; the agent passes it to its workers, which agree on the stop, save a
checkpoint and exit 0 (train/preempt.py). The script then requeues the job when the run has no summary.json
(it stopped before its last step), and the requeued job resumes from that checkpoint in the same run
directory: no step is lost. A failed run (non-zero exit) is not requeued.

The script activates the Python environment that `scaletrain slurm` ran in (a venv, a conda env, or for a
system Python the directory of its `scaletrain`) before `srun`, which passes the environment on to every
machine's task: the same path must exist on every machine (a shared file system). It activates before
`set -u`, because conda's activation scripts (and its packages') read variables that may be unset.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from scaletrain.errors import UserError

NO_ENV = "# Python: no venv or conda env was active when `scaletrain slurm` ran; its `scaletrain` goes on PATH"
# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds.
# srun mode: the process group's store at the first machine, on the job's port (env.py reads them)
_SRUN_STORE = ['export MASTER_ADDR="$head"', 'export MASTER_PORT="$port"']
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
    port: int = 0  # the rendezvous's, on the first machine (0: 29500 + the job id mod 1000, as env.py's srun rule)
    launcher: Literal["torchrun", "srun"] = "torchrun"  # an agent per machine, or a task per GPU (no torchrun)


@dataclass(frozen=True)
class PythonEnv:
    """The Python environment that the script activates on every machine."""

    kind: Literal["venv", "conda", "none"]
    prefix: str  # venv, conda: the environment's directory; none: the directory holding `scaletrain`
    conda_base: str = ""  # conda: the installation whose etc/profile.d/conda.sh defines `conda activate`


def _scaletrain_dir(argv0: str) -> str:
    """The directory of the `scaletrain` being run: the console script itself, else the one PATH finds, else
    this interpreter's scripts directory (where pip puts console scripts)."""
    ran = Path(argv0)
    if ran.name == "scaletrain" and ran.is_file():
        return str(ran.absolute().parent)
    found = shutil.which("scaletrain")
    return str(Path(found).absolute().parent) if found else sysconfig.get_path("scripts")


def detect_env(prefix: str, base_prefix: str, environ: Mapping[str, str], argv0: str) -> PythonEnv:
    """The environment of a process with this sys.prefix, sys.base_prefix, os.environ and sys.argv[0]: a venv
    (prefix != base_prefix), a conda env (CONDA_PREFIX is the prefix, and CONDA_EXE = BASE/bin/conda names its
    installation), or neither."""
    if os.path.realpath(prefix) != os.path.realpath(base_prefix):
        return PythonEnv("venv", prefix)
    conda_prefix, conda_exe = environ.get("CONDA_PREFIX", ""), environ.get("CONDA_EXE", "")
    if conda_prefix and conda_exe and os.path.realpath(conda_prefix) == os.path.realpath(prefix):
        return PythonEnv("conda", prefix, str(Path(conda_exe).parent.parent))
    return PythonEnv("none", _scaletrain_dir(argv0))


def activation(env: PythonEnv) -> list[str]:
    """The script's lines that activate ``env``: a comment saying what, then the command."""
    q = shlex.quote
    fail = '{ echo "scaletrain: could not activate the Python environment above" >&2; exit 1; }'
    if env.kind == "venv":
        return [f"# Python: the venv {q(env.prefix)}, which `scaletrain slurm` ran in",
                f"source {q(env.prefix + '/bin/activate')} || {fail}"]
    if env.kind == "conda":
        # A batch script's shell is not interactive: it has no `conda` function until conda.sh defines it.
        conda_sh = q(env.conda_base + "/etc/profile.d/conda.sh")
        return [(f"# Python: the conda env {q(env.prefix)}, which `scaletrain slurm` ran in "
                 f"(conda: {q(env.conda_base)})"),
                f"source {conda_sh} && conda activate {q(env.prefix)} || {fail}"]
    return [NO_ENV, f'export PATH={q(env.prefix)}:"$PATH"']


def check_time(text: str) -> str:
    if not _TIME.match(text):
        raise UserError(f"--time = {text!r}: expected one of Slurm's formats MINUTES, HH:MM:SS or D-HH:MM:SS; "
                        "fix: --time 04:00:00")
    return text


def time_limit_s(text: str) -> int:
    """Seconds in a --time that check_time accepted (0: no limit): MINUTES, MINUTES:SECONDS, H:M:S, D-H,
    D-H:M, D-H:M:S, as sbatch reads them."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = [int(x) for x in rest.split(":")]
    if days != "0" or "-" in text:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + sec
    if len(parts) == 3:
        return parts[0] * 3600 + parts[1] * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


def _directive_path(path: str) -> str:
    """A path as an #SBATCH option's value: double-quoted where it holds a space (sbatch splits the line there)."""
    return f'"{path}"' if any(c.isspace() for c in path) else path


def sbatch_script(job: SlurmJob, config: str, overrides: list[str], run_dir: str, env: PythonEnv, *,
                  script_args: list[str] | None = None) -> str:
    """The script's text. ``config`` and ``overrides`` (--section.key=value) are passed to every machine's
    `scaletrain train`, after the layout this function sets (nnodes, nproc, rendezvous, run dir); ``env`` is
    activated before `srun`. With ``script_args`` (a list, maybe empty) ``config`` is a script of one's own,
    run by `scaletrain launch` (srun: `python`, one task per GPU) with its own arguments first, then the run
    dir and the overrides its session reads; without a ``run_dir`` it is a plain torchrun script: its own
    arguments only, and never requeued (nothing says whether it finished)."""
    q = shlex.quote
    srun_mode = job.launcher == "srun"
    if script_args is not None:
        return _script_job(job, config, overrides, run_dir, env, [q(a) for a in script_args])
    if srun_mode:  # each task a worker: env.py reads its rank and world from SLURM_PROCID and SLURM_NTASKS
        # --nproc=1: a config's own [dist] nproc would make each task a launcher of its own job
        train = ["scaletrain", "train", q(config), "--nproc=1", f"--run.dir={q(run_dir)}", *(q(o) for o in overrides)]
        start = ["# one task per GPU, each a worker (no torchrun): rank and world from SLURM_PROCID and SLURM_NTASKS,",
                 "# the first machine's address and this port for the process group's store", *_SRUN_STORE]
    else:
        train = ["scaletrain", "train", q(config), f"--nproc={job.gpus_per_node}", '--nnodes="$SLURM_NNODES"',
                 '--rdzv-endpoint="$head:$port"', '--dist.rdzv_id="$SLURM_JOB_ID"', f"--run.dir={q(run_dir)}",
                 *(q(o) for o in overrides)]
        start = ["# the first machine hosts the rendezvous; every machine's agent starts its GPUs' workers"]
    return _lines(job, env, start, train, run_dir)


def _script_job(job: SlurmJob, script: str, overrides: list[str], run_dir: str, env: PythonEnv,
                own: list[str]) -> str:
    q = shlex.quote
    session = [f"--run.dir={q(run_dir)}", *(q(o) for o in overrides)] if run_dir else []
    if job.launcher == "srun":  # a session adopts the Slurm task (env.py), as `scaletrain train` does
        train = ["python", q(script), *own, *session, "--dist.nproc=1"]
        start = ["# one task per GPU, each a worker of the script's session (no torchrun): rank and world from",
                 "# SLURM_PROCID and SLURM_NTASKS, the first machine's address and this port for its store",
                 *_SRUN_STORE]
    else:
        train = ["scaletrain", "launch", f"--nproc={job.gpus_per_node}", '--nnodes="$SLURM_NNODES"',
                 '--rdzv-endpoint="$head:$port"', '--rdzv-id="$SLURM_JOB_ID"', q(script), *own, *session]
        start = ["# the first machine hosts the rendezvous; every machine's agent starts the script on its GPUs"]
    return _lines(job, env, start, train, run_dir)


def _lines(job: SlurmJob, env: PythonEnv, start: list[str], train: list[str], run_dir: str) -> str:
    q = shlex.quote
    srun_mode = job.launcher == "srun"
    tasks = job.gpus_per_node if srun_mode else 1
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", f"--ntasks-per-node={tasks}",
                  f"--gpus-per-node={job.gpus_per_node}", f"--cpus-per-task={job.cpus_per_task}",
                  f"--time={job.time}", f"--signal=USR1@{job.signal_s}", "--requeue", "--open-mode=append",
                  # the directory `scaletrain slurm` ran in, which the config's and run dir's paths are relative to
                  # (Slurm's default is wherever sbatch runs), and the job's output there (opened before the script)
                  f"--chdir={_directive_path(os.getcwd())}", "--output=slurm-%x-%j.out"]
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    requeue = [
        "# exit 0 without summary.json: stopped by USR1/TERM after saving a checkpoint; run again from it",
        f'if [ "$code" -eq 0 ] && [ ! -f {q(run_dir + "/summary.json")} ]; then',
        '  echo "scaletrain: stopped before the last step; requeueing job $SLURM_JOB_ID to resume"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi"] if run_dir else [
        "# a script without a scaletrain session: not requeued (nothing here says whether it finished, and Slurm's",
        "# USR1 before the time limit stops it unless it handles the signal itself)"]
    lines = ["#!/bin/bash",
             "# Written by `scaletrain slurm`; submit with: sbatch THIS_FILE",
             *(f"#SBATCH {d}" for d in directives),
             "# srun passes the environment activated here on to every machine: its path must exist on each",
             *activation(env),
             "set -uo pipefail",
             'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             *(["# 29500 + the job id mod 1000: jobs sharing a first machine do not take one port",
                "port=$((29500 + SLURM_JOB_ID % 1000))"] if not job.port else [f"port={job.port}"]),
             *start,
             "# Slurm >= 22.05: srun no longer inherits the job's --cpus-per-task; without it each task (an",
             "# agent and its workers, or a worker, with their loader processes) may be confined to one CPU",
             f"srun --kill-on-bad-exit=1 --cpus-per-task={job.cpus_per_task} {' '.join(train)}",
             "code=$?",
             *requeue,
             'exit "$code"']
    return "\n".join(lines) + "\n"
