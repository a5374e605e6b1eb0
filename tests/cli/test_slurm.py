"""scaletrain slurm: the sbatch script, and what it does when Slurm stops the run early.

No Slurm here: the end-to-end test runs the script with bash, `srun` and `scontrol` replaced by two small
shell stubs (srun runs the command once; `scontrol show hostnames` says 127.0.0.1; `scontrol requeue` writes
down the job id). The run is stopped at a step by the chaos switch's SIGUSR1 (what Slurm's --signal=USR1@S
sends), saves, exits 0, and the script requeues it; the second start of the same script (the requeued job)
resumes from the checkpoint, finishes, and is not requeued again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.cluster.slurm import NO_ENV, PythonEnv, activation, detect_env

SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done  # srun's own options
exec "$@"
"""
SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; exit 0; fi
if [ "$1" = "requeue" ]; then echo "$2" >> "$REQUEUED"; exit 0; fi
exit 1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_script_runs_one_agent_per_machine_with_the_users_options(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["slurm", "gpt-stdlib", "--nodes", "4", "--gpus-per-node", "8", "--time", "1-00:00:00",
                 "--partition", "h100", "--account", "lab", "--out", str(out), "--parallel.strategy=hsdp",
                 "--train.precision=bf16-mixed", "--run.dir=/scratch/gpt run"]) == 0
    assert "sbatch " + str(out) in capsys.readouterr().err
    text = out.read_text()
    directives = [ln.removeprefix("#SBATCH ") for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert directives == ["--job-name=scaletrain-gpt-stdlib", "--nodes=4", "--ntasks-per-node=1",
                          "--gpus-per-node=8", "--cpus-per-task=64", "--time=1-00:00:00", "--signal=USR1@120",
                          "--requeue", "--open-mode=append", f"--chdir={os.getcwd()}", "--output=slurm-%x-%j.out",
                          "--partition=h100", "--account=lab"]  # --chdir: relative paths hold wherever sbatch runs
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    # --cpus-per-task again on srun: from Slurm 22.05 a step no longer inherits the job's.
    assert srun == ("srun --kill-on-bad-exit=1 --cpus-per-task=64 scaletrain train gpt-stdlib --nproc=8 "
                    "--nnodes=\"$SLURM_NNODES\" --rdzv-endpoint=\"$head:$port\" "
                    "--dist.rdzv_id=\"$SLURM_JOB_ID\" --run.dir='/scratch/gpt run' --parallel.strategy=hsdp "
                    "--train.precision=bf16-mixed")
    # the port from the job id (a fixed 29500 collided with another job's, or anyone's torchrun, on a shared node)
    assert "port=$((29500 + SLURM_JOB_ID % 1000))" in text.splitlines()
    assert subprocess.run(["bash", "-n", str(out)], check=False).returncode == 0


def test_the_script_activates_the_venv_it_was_written_from(tmp_path, capsys):
    assert sys.prefix != sys.base_prefix, "the tests run in the project's venv"
    assert main(["slurm", "digits", "--gpus-per-node", "2", "--cpus-per-task", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = lines.index("set -uo pipefail")
    # After the #SBATCH lines (sbatch reads none after the first command), before `set -u` and srun.
    assert lines[body - 3].startswith("# srun passes the environment activated here on to every machine")
    fail = '{ echo "scaletrain: could not activate the Python environment above" >&2; exit 1; }'
    assert lines[body - 2:body] == [f"# Python: the venv {sys.prefix}, which `scaletrain slurm` ran in",
                                    f"source {sys.prefix}/bin/activate || {fail}"]
    assert lines[body - 4].startswith("#SBATCH ")
    assert next(ln for ln in lines if ln.startswith("srun ")).startswith(
        "srun --kill-on-bad-exit=1 --cpus-per-task=12 scaletrain train digits --nproc=2 ")


def _bash(lines: list[str], then: str) -> str:
    proc = subprocess.run(["bash", "-c", "\n".join([*lines, "set -u", then])], capture_output=True, text=True,
                          check=False, env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_conda_env_is_activated_with_conda_sh(tmp_path):
    base, env = tmp_path / "mini conda", tmp_path / "mini conda" / "envs" / "my env"
    (base / "etc" / "profile.d").mkdir(parents=True)
    (base / "bin").mkdir()
    env.mkdir(parents=True)
    # conda.sh defines the `conda` shell function; this one says what it was asked.
    (base / "etc" / "profile.d" / "conda.sh").write_text('conda() { echo "conda $*"; }\n')
    conda = {"CONDA_PREFIX": str(env), "CONDA_EXE": str(base / "bin" / "conda")}
    found = detect_env(str(env), str(env), conda, "scaletrain")
    assert found == PythonEnv("conda", str(env), str(base))
    lines = activation(found)
    assert lines[0] == f"# Python: the conda env '{env}', which `scaletrain slurm` ran in (conda: '{base}')"
    assert lines[1].startswith(f"source '{base}/etc/profile.d/conda.sh' && conda activate '{env}' || {{")
    assert _bash(lines, "true") == f"conda activate {env}"
    # A venv made from a conda env's Python is the venv, not the conda env.
    assert detect_env("/v", str(env), conda, "scaletrain").kind == "venv"


def test_a_system_python_puts_its_scaletrain_on_path(tmp_path):
    bin_dir = tmp_path / "local bin"
    bin_dir.mkdir()
    (bin_dir / "scaletrain").write_text("#!/bin/sh\n")
    (bin_dir / "scaletrain").chmod(0o755)
    found = detect_env("/usr", "/usr", {}, str(bin_dir / "scaletrain"))
    assert found == PythonEnv("none", str(bin_dir))
    lines = activation(found)
    assert lines == [NO_ENV, f"export PATH='{bin_dir}':\"$PATH\""]
    assert NO_ENV.startswith("# Python: no venv or conda env was active")
    assert _bash(lines, "command -v scaletrain") == str(bin_dir / "scaletrain")


def test_a_failed_activation_stops_the_script(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("\n".join(["#!/bin/bash", *activation(PythonEnv("venv", str(tmp_path / "gone"))),
                                 "echo still here"]) + "\n")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "still here" not in proc.stdout
    assert "could not activate the Python environment" in proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "2"], ["--dist.nproc = '2'", "sets it from --gpus-per-node", "fix: drop it"]),
    (["--nodes", "0"], ["--nodes = '0'", "an integer >= 1", "fix: --nodes 2"]),
    (["--time", "4h"], ["--time = '4h'", "HH:MM:SS", "fix: --time 04:00:00"]),
    (["--port", "70000"], ["--port = '70000'", "[1, 65535]"]),
    (["--parallel.strategy=fsdp", "--memory.cpu_offload=maybe"], ["memory.cpu_offload = 'maybe'"]),
    # found probing: each was said only on the cluster, after the queue, or named a flag slurm refuses
    (["--nodes", "2", "--gpus-per-node", "3", "--train.global_batch=100"],
     ["train.global_batch = 100", "32 x 6 = 192", "fix: --train.global_batch=192"]),
    (["--nodes", "100000"], ["--nodes = '100000'", "at most 65,536", "fix: --nodes 2"]),
    (["--signal-s", "100000"], ["--signal-s = '100000'", "at most 65535"]),
    (["--time", "2", "--signal-s", "300"], ["--signal-s = 300", "--time 2 is 120 s", "fix: --signal-s 12"]),
    (["--time", "1-12:00:00", "--signal-s", "200000"], ["at most 65535"]),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert main(["slurm", "digits", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def test_an_existing_script_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    out.write_text("mine\n")
    assert main(["slurm", "digits", "--out", str(out)]) == 2
    assert "exists, and is not overwritten" in capsys.readouterr().err and out.read_text() == "mine\n"


def _stubbed_slurm(tmp_path: Path, job_id: str) -> dict[str, str]:
    """The environment a batch script runs in here: srun and scontrol stubbed, job ``job_id`` on one machine,
    ``scontrol requeue`` writing the id to tmp_path / "requeued"."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "SLURM_JOB_ID": job_id, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node01",
           "REQUEUED": str(tmp_path / "requeued")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def test_stopped_by_the_signal_it_is_requeued_and_resumes_without_losing_a_step(tmp_path):
    env = _stubbed_slurm(tmp_path, "4242")
    script = tmp_path / "job.sbatch"
    assert main(["slurm", "digits", "--nodes", "1", "--gpus-per-node", "2", "--port", str(free_port()),
                 "--out", str(script), "--run.dir=run", "--train.max_steps=24", "--log.every=4",
                 "--train.progress=false", "--chaos.signal_rank=0", "--chaos.signal_step=5"]) == 0

    first = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=240, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "requeued").read_text() == "4242\n"
    stopped = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert stopped["kind"] == "stopped" and stopped["reason"] == "SIGUSR1" and stopped["step"] == 8
    assert not (tmp_path / "run" / "summary.json").exists()

    second = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=240, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from run/checkpoints/step-00000008: step 8 of 24" in second.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 24
    assert (tmp_path / "requeued").read_text() == "4242\n"  # finished: not requeued again


FIT_SCRIPT = """
import sys, torch, scaletrain
x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
scaletrain.fit(torch.nn.Linear(8, 2), (x, (x[:, 0] > 0).long()), argv=sys.argv[1:],
               config={"train.max_steps": 24, "log.every": 4, "train.progress": False, "checkpoint.every": 100})
"""


def test_a_script_of_ones_own_runs_through_launch_on_every_machine(tmp_path, capsys, monkeypatch):
    """A fit() or session script: `scaletrain launch` on each machine, its own arguments (after --) first, then
    the run directory and the options its session reads, requeued as a recipe is. A script written for plain
    torchrun (it never names scaletrain): its own arguments only, never requeued; options no session would read,
    and srun's tasks (ranks from Slurm's variables, which it does not read), are one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fit_job.py").write_text(FIT_SCRIPT)
    (tmp_path / "plain.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    (tmp_path / "spawns.py").write_text("import torch.distributed as dist\nimport torch.multiprocessing as mp\n"
                                        "def work(rank):\n    dist.init_process_group('nccl', rank=rank, world_size=8)\n"
                                        "mp.spawn(work, nprocs=8)\n")
    assert main(["slurm", "fit_job.py", "--nodes", "2", "--gpus-per-node", "4", "--parallel.strategy=fsdp",
                 "--", "--data", "my dir"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --job-name=scaletrain-fit_job" in text.splitlines()
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    assert srun == ("srun --kill-on-bad-exit=1 --cpus-per-task=32 scaletrain launch --nproc=4 "
                    "--nnodes=\"$SLURM_NNODES\" --rdzv-endpoint=\"$head:$port\" --rdzv-id=\"$SLURM_JOB_ID\" "
                    "fit_job.py --data 'my dir' --run.dir=runs/fit_job --parallel.strategy=fsdp")
    assert "if [ \"$code\" -eq 0 ] && [ ! -f runs/fit_job/summary.json ]; then" in text.splitlines()
    assert main(["slurm", "fit_job.py", "--gpus-per-node", "2", "--launcher", "srun"]) == 0
    srun = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("srun "))
    assert srun.endswith("python fit_job.py --run.dir=runs/fit_job --dist.nproc=1")

    assert main(["slurm", "plain.py", "--nodes", "2", "--gpus-per-node", "8", "--", "--lr", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(ln for ln in lines if ln.startswith("srun ")).endswith(' --rdzv-id="$SLURM_JOB_ID" plain.py --lr 0.1')
    assert not any("requeue" in ln for ln in lines if not ln.startswith("#"))
    assert subprocess.run(["bash", "-n"], input="\n".join(lines), text=True, check=False).returncode == 0
    for argv, said in [(["plain.py", "--train.max_steps=10"], ("--train.max_steps = '10': plain.py never names "
                                                                "scaletrain, so no session reads its options; fix:")),
                       (["plain.py", "--launcher", "srun"], "--launcher = 'srun': plain.py never names scaletrain"),
                       (["gone.py"], "script 'gone.py' not found; fix: check the path"),
                       # a job that would have hung on every machine, found before the sbatch is written
                       (["spawns.py"], ("spawns.py starts its own processes (mp.spawn, line 5) and forms their group "
                                       "itself (init_process_group with its own rank and world_size)"))]:
        assert main(["slurm", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"scaletrain: error: {said}"), err


def test_a_scripts_job_stopped_by_the_signal_is_requeued_and_resumes(tmp_path):
    env = _stubbed_slurm(tmp_path, "4343")
    (tmp_path / "fit_job.py").write_text(FIT_SCRIPT)
    script = tmp_path / "job.sbatch"
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)  # the script's --chdir, and the path of fit_job.py as given
        assert main(["slurm", "fit_job.py", "--nodes", "1", "--gpus-per-node", "2", "--port", str(free_port()),
                     "--out", str(script), "--run.dir=run", "--chaos.signal_rank=0", "--chaos.signal_step=5"]) == 0
    finally:
        os.chdir(cwd)
    for attempt in (1, 2):
        done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / "requeued").read_text() == "4343\n"  # once: after the first attempt only
        assert (tmp_path / "run" / "summary.json").exists() == (attempt == 2)
    assert "resumed from run/checkpoints/step-00000008: step 8 of 24" in done.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 24


def test_slurm_time_limits_in_seconds():
    from scaletrain.cluster.slurm import time_limit_s

    assert [time_limit_s(t) for t in ("90", "0", "1:30", "04:00:00", "1-12", "1-12:30", "1-12:00:05")] == \
        [5400, 0, 90, 14400, 129600, 131400, 129605]


def test_srun_tasks_are_workers_whatever_the_configs_own_nproc(tmp_path, capsys):
    """A TOML with [dist] nproc = 2 made each srun task launch a 2-worker job of its own (two jobs in one run
    directory): the task's command says --nproc=1, after the config, so env.py adopts the Slurm task."""
    toml = tmp_path / "two.toml"
    toml.write_text('[data]\nsource = "digits"\n[model]\nname = "mlp"\n[dist]\nnproc = 2\n', encoding="utf-8")
    out = tmp_path / "job.sbatch"
    assert main(["slurm", str(toml), "--nodes", "2", "--gpus-per-node", "1", "--launcher", "srun",
                 "--out", str(out)]) == 0
    line = next(x for x in out.read_text().splitlines() if x.startswith("srun "))
    assert f"scaletrain train {toml} --nproc=1 " in line
