"""What the launcher's environment says about this process, read without importing torch (seconds): the
CLI decides whether it is a worker or the launcher before anything heavy is imported."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, MutableMapping

# "PID EXITCODE" of the worker of this machine that failed last, set by scaletrain's launcher (cluster/
# torchrun.py) for the workers of the restarted group, which inherit its environment.
FAILED_WORKER_ENV = "SCALETRAIN_FAILED_WORKER"
# A directory `scaletrain launch` gives the workers of a script of one's own (tell_launcher): in it rank 0 of the
# session the script opens names its run directory (RUN_DIR: the launcher's word after a stop signal), and a
# worker that said a usage error in one line marks it (USAGE_SAID: its exit code 2 is that error), and one that
# said why training failed marks that, with the launcher's restart count (FAILURE_SAID).
LAUNCH_DIR_ENV = "SCALETRAIN_LAUNCH_DIR"
RUN_DIR, USAGE_SAID, FAILURE_SAID = "run_dir", "usage_said", "failure_said"
# The stop signal a launcher received before its workers could take one (held_signal), passed down to them.
HELD_SIGNAL_ENV = "SCALETRAIN_HELD_SIGNAL"
_held: list[int] = []


def hold_stop_signal() -> None:
    """From a training command's first moment: keep a SIGUSR1 (Slurm's --signal=USR1@S, the time limit near) for
    the run's own handler (train/preempt.py PreemptFlag.install, or the launcher's). Its default action kills the
    process: one signalled while it was starting (importing torch, building the model) ended without the
    checkpoint and the exit 0 its batch script requeues on, and the job was lost."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: _held.append(signum))


def held_signal() -> int:
    """The stop signal held since the process began (hold_stop_signal), or one its launcher held for it
    (HELD_SIGNAL_ENV); 0 for none. Taken once: asked again, 0."""
    signum = _held[0] if _held else int(os.environ.pop(HELD_SIGNAL_ENV, "0") or 0)
    _held.clear()
    return signum


def tell_launcher(name: str, text: str = "") -> None:
    """Under `scaletrain launch`: file ``name`` in its directory, holding ``text``; nothing otherwise (and
    nothing lost if it cannot be written: the launcher then says less)."""
    where = os.environ.get(LAUNCH_DIR_ENV)
    if where:
        try:
            with open(os.path.join(where, name), "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            pass


def under_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (torchrun, or a compatible one) has set this process's rank and world. RANK=0 and
    WORLD_SIZE=1 with no MASTER_ADDR (no launcher sets one without the other; a shell or a notebook kept them)
    are one process: there is nothing to join."""
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env and ("MASTER_ADDR" in env or (env["RANK"], env["WORLD_SIZE"]) != ("0", "1"))


_TOGETHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_COUNTS = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "MASTER_PORT": 1}  # the least


def launcher_env_problem(environ: Mapping[str, str] | None = None) -> tuple[str, str, str] | None:
    """What in the launcher's variables keeps a process group from forming, as (check, problem, fix); None
    where nothing does. A launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together; some of them
    left in a shell (an `export RANK=1` from another job) made torch raise at init ("environment variable
    MASTER_ADDR expected") or a run of world size 2 with no group, and a value that is not a number a ValueError.
    RANK=0 or WORLD_SIZE=1 alone, or both with no address, say one process: no problem (under_launcher)."""
    env = os.environ if environ is None else environ
    for name, least in _COUNTS.items():
        value = env.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) >= least):
            problem = f"{name}={value!r} in the environment is not a whole number >= {least}"
            return "launcher-value", problem, f"let the launcher set it, or unset {name}"
    have = [v for v in _TOGETHER if v in env]
    one = {k: env[k] for k in ("RANK", "WORLD_SIZE") if k in env}.items() <= {("RANK", "0"), ("WORLD_SIZE", "1")}
    if len(have) < len(_TOGETHER) and (under_launcher(env) or not one):
        missing = [v for v in _TOGETHER if v not in env]
        problem = f"{', '.join(have)} set but {', '.join(missing)} not: the process group cannot form"
        return "launcher-partial", problem, ("start the job with torchrun or scaletrain launch (they set all of "
                                             f"them), or unset {' '.join(have)}")
    for rank, world in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in env and world in env and not int(env[rank]) < int(env[world]):
            size = int(env[world])
            return ("rank-range", f"{rank} {env[rank]} is outside 0..{size - 1} ({world} {size})",
                    f"let the launcher set {rank} and {world}")
    return None


def launcher_overrides(nproc: int) -> str | None:
    """Under a launcher, the warning for a dist.nproc (``--nproc``) other than the workers it started per machine,
    which it ignores (the launcher decides the world); None where they agree, or from any rank but 0."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if nproc in (1, local) or os.environ.get("RANK") != "0":
        return None
    return (f"scaletrain: warning: --nproc {nproc} ignored: this process runs under a launcher that started "
            f"{local} per machine (world size {os.environ.get('WORLD_SIZE')})")


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist ("gpu[07-09,12],login1" -> "gpu07"; "rack[1-2]-n[01-04]" -> "rack1-n01"):
    every bracket's first number, its zero padding kept (scontrol show hostnames' first line)."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # the top-level commas separate hosts
    return re.sub(r"\[([^\],-]+)[^\]]*\]", lambda m: m.group(1), first)


def _tasks_on_node(tasks_per_node: str, node: int) -> int:
    """This node's task count from SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first 3 nodes, then 1)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE = {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node]


def adopt_slurm_task(environ: MutableMapping[str, str] | None = None) -> bool:
    """Under `srun` with one task per GPU and no torchrun (the launcher DESIGN.md calls srun mode): set RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from Slurm's SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID, SLURM_TASKS_PER_NODE / SLURM_NODEID and the step's node list (its first host is the
    rendezvous), as torchrun would have; MASTER_PORT, where not set, is 29500 + the job id mod 1000 (jobs sharing
    a first node do not collide). Only in a task of an srun step (SLURM_STEP_ID) of two or more tasks, and never
    where a launcher set RANK already (a batch script's own process is no step's task); `scaletrain train` asks
    only when it is not to launch workers itself (--nproc 1: the torchrun agents `scaletrain slurm` starts one
    per machine keep their role). Returns True when it set them."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return False
    world = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    if world < 2:
        return False
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    env.update({"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": str(_tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0"))))})
    env.setdefault("MASTER_ADDR", _first_host(nodelist) if nodelist else "127.0.0.1")
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
    return True


def die_with_launcher() -> None:
    """A worker under a launcher (torchrun's agent, our own or the user's): ask Linux to SIGKILL this process when
    its parent dies (prctl PR_SET_PDEATHSIG). torchrun's workers otherwise outlive an agent that was killed: the
    orphans of one machine train on with the other machines' workers, or hang, until a collective times out. A
    no-op off Linux, and where the parent is already gone (then this exits: there is no job to be part of)."""
    if under_launcher() and (ask := dies_with(os.getppid())) is not None:
        ask()


def dies_with(parent: int) -> Callable[[], None] | None:
    """A function that asks Linux to SIGKILL the process calling it when its parent dies (PR_SET_PDEATHSIG), and
    exits at once (code 1) where ``parent`` is gone already: for a worker itself (die_with_launcher), or for a
    child between fork and exec (cluster/torchrun.py: the request survives exec), libc looked up here, before.
    None off Linux or without prctl."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def ask() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return ask
