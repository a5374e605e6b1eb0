"""The distributed environment: who am I, on what device, talking over which backend.

A single process with no launcher around it is world size 1 and starts no process group. Under torchrun
(or anything that sets RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/MASTER_PORT) the process joins the group.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import random
import socket
import sys
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import DistConfig
from scaletrain.env import (
    FAILED_WORKER_ENV,
    adopt_slurm_task,
    die_with_launcher,
    launcher_env_problem,
    under_launcher,
)
from scaletrain.errors import ConfigError, Reported, TrainingFailed, UserError
from scaletrain.observe import flight

T = TypeVar("T")


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str  # the collective backend; "none" when world size is 1 and no group was started
    owns_group: bool = False  # this runtime started the process group, so it also ends it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def pick_device(cfg: DistConfig, local_rank: int) -> torch.device:
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("dist.device", cfg.device, "cpu or auto on a machine without CUDA",
                              "--device=auto (or cpu)")
        index = int(want[5:]) if ":" in want else local_rank % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


def pick_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend", "nccl", "gloo (or auto) on a CPU device", "--dist.backend=auto")
    return cfg.backend


def init(cfg: DistConfig) -> Runtime:
    """Read the launcher's environment (torchrun's, or srun's one task per GPU: env.py adopt_slurm_task), pick
    device and backend, and join the process group if there is one."""
    adopt_slurm_task()
    problem = launcher_env_problem()
    if problem is not None:
        raise UserError(f"{problem[1]}; fix: {problem[2]}")
    rank, world = (_env_int("RANK", 0), _env_int("WORLD_SIZE", 1)) if under_launcher() else (0, 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    device = pick_device(cfg, local_rank)
    backend = pick_backend(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if under_launcher() and not dist.is_initialized():
        die_with_launcher()  # a script's worker too (scaletrain launch, torchrun): not an orphan of a dead agent
        flight.enable(cfg.flight_recorder)
        timeout = timedelta(seconds=cfg.timeout_s)
        met = _group_store(rank, world, timeout)
        extra = {"store": met[0], "rank": rank, "world_size": world} if met is not None else {}
        dist.init_process_group(backend=backend, timeout=timeout,
                                device_id=device if device.type == "cuda" else None, **extra)
        if met is not None:
            _remember(met[1])
        owns = True
    elif not under_launcher():
        backend = "none"
    rt = Runtime(rank, local_rank, world, local_world, device, backend, owns)
    _announce(rt)
    speak_once(rank)
    if cfg.check_network:
        _check_network(rt)
    return rt


def _check_network(rt: Runtime) -> None:
    """dist.check_network: the bandwidth between every two machines (cluster/pairwise.py), said by rank 0
    before step 0. A slow node or link is a warning; the run goes on either way."""
    log = logging.getLogger("scaletrain")
    if not rt.distributed or rt.world_size <= rt.local_world_size:
        log.warning("dist.check_network is set but this job runs on one machine: no link between machines to "
                    "measure, nothing checked")
        return
    from scaletrain.cluster.pairwise import measure, report

    result = report(measure(rt.rank, rt.local_rank, rt.device))
    for line in result["lines"] if rt.is_main else []:
        if result["slow"]:
            log.warning("network check before step 0: %s", line)
        else:
            print(f"scaletrain: network check before step 0: {line}", file=sys.stderr, flush=True)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """``scaletrain: warning: ...`` on sys.stderr as it is when a record is emitted (as logging's lastResort)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def format(self, record: logging.LogRecord) -> str:
        return f"scaletrain: {record.levelname.lower()}: {record.getMessage()}"


def speak_once(rank: int) -> None:
    """Warnings once per job, by rank 0: every rank runs the same code, so N copies say nothing more.

    scaletrain's own log warnings print as ``scaletrain: warning: ...`` on rank 0 only (not propagated to
    the root logger: a user's logging setup would print them twice). On other ranks Python's warnings (torch's
    included) are silenced, unless the user chose a warnings filter (-W / PYTHONWARNINGS)."""
    logger = logging.getLogger("scaletrain")
    handler = next((h for h in logger.handlers if getattr(h, "_scaletrain", False)), None)
    if handler is None:
        handler = _Stderr()
        handler._scaletrain = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    handler.setLevel(logging.WARNING if rank == 0 else logging.CRITICAL + 1)
    if rank != 0 and not sys.warnoptions:
        warnings.simplefilter("ignore")


def _group_store(rank: int, world: int, timeout: timedelta) -> tuple[dist.Store, int] | None:
    """Under torchrun's agent store: the store the process group meets in, a namespace of torchrun's agent store
    that no earlier group of the job used, and that group's number (see _meet); None elsewhere (torch's own
    env:// store, fresh for each group).

    The agent's store lives as long as the job, across its restarts, and the keys through which Gloo ranks
    exchange their addresses would otherwise be the same for every group: a rank of a restarted group read the
    address of a worker that was killed ("Gloo connectFullMesh failed ... Connection refused"), as did the second
    group of one process (fit() after fit()). A namespace per TORCHELASTIC_RESTART_COUNT did not do: each agent
    counts its own restarts (the agent whose worker died counts 1, another restarts its workers because the
    membership changed and still counts 0), so the ranks of one group waited on different keys until
    dist.timeout_s.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = _agent_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout)
    number = _meet(agent, rank, world, timeout)
    return dist.PrefixStore(f"{_namespace_of(number)}/pg", agent), number


def _agent_store(host: str, port: int, timeout: timedelta) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


_JOIN = "scaletrain/join"  # the keys through which the ranks of a new group meet (in the agent's store)


def _meet(agent: dist.Store, rank: int, world: int, timeout: timedelta) -> int:
    """The number of the group these ``world`` ranks form, the same on every rank, one no earlier group of the
    job had (the job's count of groups, one more on each). Rank 0 takes it; each other rank writes a nonce of its
    own (uuid4) under its rank and waits for rank 0's answer under that nonce, then says it joined. Rank 0 answers
    every nonce it reads until all the others joined this number: a nonce an earlier rank left (a dead worker of
    an earlier round, this process's previous group) gets an answer nobody waits for, and a "joined" under an
    earlier number does not count. No counter of any one agent, nothing read that an earlier group could have
    written. Past ``timeout``, a TrainingFailed naming who did not come."""
    deadline = time.monotonic() + timeout.total_seconds()
    fix = (f"fix: see that rank's output (a worker that did not start, or a machine that cannot reach the store at "
           f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}); --dist.timeout_s="
           f"{timeout.total_seconds():.0f} bounds the wait")
    if rank != 0:
        nonce = uuid.uuid4().hex
        agent.set(f"{_JOIN}/hello/{rank}", nonce)
        answer = f"{_JOIN}/answer/{nonce}"
        try:
            agent.wait([answer], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except dist.DistError:
            raise TrainingFailed(f"rank {rank} could not join the process group: no answer from rank 0 within "
                                 f"{timeout.total_seconds():.0f} s; {fix}") from None
        number = int(agent.get(answer))
        agent.delete_key(answer)
        agent.set(f"{_namespace_of(number)}/joined/{rank}", nonce)
        agent.add(f"{_namespace_of(number)}/joined", 1)
        return number
    number = int(agent.add("scaletrain/groups", 1))
    joined = f"{_namespace_of(number)}/joined"
    hellos = [f"{_JOIN}/hello/{r}" for r in range(1, world)]
    answered: set[bytes] = set()
    while world > 1:
        left = deadline - time.monotonic()
        if left > 0 and agent.check(hellos):
            new = [n for n in agent.multi_get(hellos) if n not in answered]
            if new:
                agent.multi_set([f"{_JOIN}/answer/{n.decode()}" for n in new], [str(number)] * len(new))
                answered.update(new)
            if int(agent.add(joined, 0)) >= world - 1:
                break
        if left <= 0:
            absent = [str(r) for r in range(1, world) if not agent.check([f"{joined}/{r}"])]
            if not absent:  # the last one joined as time ran out
                break
            who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {', '.join(absent)}"
            raise TrainingFailed(f"rank 0 could not form the process group: {who} did not join within "
                                 f"{timeout.total_seconds():.0f} s; {fix}")
        time.sleep(0.02)
    return number


# The process group init() started under the agent's store (a weak reference: runtime.close must be able to free
# it) and its number (_meet): while that group is the default one, scaletrain's own keys (host names, failure
# records) are that group's, and the group before it is the one whose failure a restarted group reports.
_GROUP: tuple[weakref.ref[Any], int] | None = None


def _remember(number: int) -> None:
    global _GROUP
    _GROUP = (weakref.ref(dist.group.WORLD), number)


def _namespace_of(number: int) -> str:
    return f"scaletrain/group-{number}"


def _number() -> int | None:
    """The number of the current group (_meet), or None where it is not one init() met through the agent's store."""
    if _GROUP is None or not (dist.is_available() and dist.is_initialized()):
        return None
    ref, number = _GROUP
    return number if ref() is dist.group.WORLD else None


def _namespace() -> str:
    """Where this group's scaletrain keys are in the job's store: its own namespace (the same on every rank, see
    _meet), else, for a group init() did not meet (the user's own, one started by env:// under Slurm), the
    launcher's restart count."""
    number = _number()
    return _namespace_of(number) if number is not None else f"scaletrain/{_attempt()}"


def _previous() -> str | None:
    """The namespace of the group before this one in the job (that of the attempt before, for a group init() did
    not meet), or None for the job's first."""
    number = _number()
    if number is not None:
        return _namespace_of(number - 1) if number > 1 else None
    return f"scaletrain/{int(_attempt()) - 1}" if int(_attempt()) > 0 else None


def _store() -> dist.Store | None:
    """The job's key-value store (torchrun's agent store, kept across restarts), or None. The process group
    sees it through a prefix (_group_store); scaletrain's keys carry the group's namespace themselves
    (_namespace), so that a restarted group can read what the previous one wrote (_previous)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _announce(rt: Runtime) -> None:
    """Record this rank's host (and which rank this pid is) in the store once, so that a failure can name where
    a missing rank runs; after a restart, pass on what this machine's launcher saw of the previous failure."""
    store = _store() if rt.distributed else None
    if store is None:
        return
    host = socket.gethostname()
    here, prev = _namespace(), _previous()
    store.set(f"{here}/host/{rt.rank}", host)
    store.set(f"{here}/rank-of/{host}/{os.getpid()}", str(rt.rank))
    if rt.local_rank == 0 and prev is not None and FAILED_WORKER_ENV in os.environ:
        _pass_on_failure(store, prev, host, os.environ[FAILED_WORKER_ENV])


def _pass_on_failure(store: dist.Store, prev: str, host: str, failed: str) -> None:
    """``failed`` ("PID EXITCODE", from this machine's launcher) becomes the previous group's "died" record
    (rank, pid, exit code) if that pid was a rank of it that did not report a failure itself: a rank that did
    was stopped by another one's death (a launcher names the first of its own workers to fail)."""
    pid, exitcode = failed.split()
    key = f"{prev}/rank-of/{host}/{pid}"
    if store.check([key]):
        rank = store.get(key).decode()
        if not store.check([f"{prev}/failed/{rank}"]):
            store.set(f"{prev}/died", f"{rank} {pid} {exitcode}")


def missing_peers(rt: Runtime, step: int, wait_s: float = 2.0) -> list[tuple[int, str]]:
    """After a collective failed: the ranks that did not also report the failure within wait_s, as
    (rank, host). Every surviving rank calls this at its failure, so the ranks that never answer are the
    hung or dead ones. Costs nothing until a failure."""
    store = _store() if rt.distributed else None
    if store is None:
        return []
    prefix = _namespace()
    try:
        store.set(f"{prefix}/failed/{rt.rank}", str(step))
        store.set(f"{prefix}/failed-at", str(step))  # for a restarted group: the step the failure stopped
        deadline = time.monotonic() + wait_s
        missing = list(range(rt.world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{prefix}/failed/{r}"])]
            time.sleep(0.1)
        hosts = []
        for r in missing:
            key = f"{prefix}/host/{r}"
            hosts.append((r, store.get(key).decode() if store.check([key]) else "?"))
        if missing:
            store.set(f"{prefix}/missing", ", ".join(map(str, missing)))
        return hosts
    except (RuntimeError, dist.DistError):  # the store itself is gone (the agent died): nothing to name
        return []


def collective_failure(err: RuntimeError, rt: Runtime, step: int, timeout_s: int,
                       run_dir: Path | None = None) -> Exception:
    """A failed or timed-out collective during ``step`` (0: before the first) becomes one line naming the ranks
    that did not answer (recording the step for a restarted group); any other error is returned as it is (raise
    it bare, so its traceback stays the user's). With ``run_dir`` (and the flight recorder on) this rank writes
    what it was doing and asks every other rank to (observe/flight.py), waiting a few seconds for the silent ones'
    records."""
    text = str(err)
    looks = isinstance(err, dist.DistError) or any(
        s in text for s in ("gloo", "Gloo", "NCCL", "Timed out", "timed out", "Connection closed", "Connection reset"))
    if not (rt.distributed and looks):
        return err
    recorded = run_dir is not None and flight.enabled()
    if recorded:
        _ask_for_records(rt, run_dir, step)  # type: ignore[arg-type]
    missing = missing_peers(rt, step)
    if recorded and missing:  # the silent ranks' watchers write within half a second of the flag
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not all(
                (run_dir / flight.DIR / f"rank-{r:05d}.json").exists() for r, _ in missing):  # type: ignore[operator]
            time.sleep(0.1)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    who = ", ".join(f"rank {r} (host {h})" for r, h in missing) or "no rank could be named"
    look = f"scaletrain diagnose {run_dir} says where each rank was" if recorded else \
        "look at its stack (py-spy dump)"
    during = f"during step {step}" if step else "before the first step"
    return TrainingFailed(f"a collective failed {during} ({first}); not answering: {who}; fix: if a rank "
                          f"hangs, {look}; --dist.timeout_s={timeout_s} bounds the wait, and "
                          "--max-restarts lets torchrun restart the group from the last checkpoint")


def _ask_for_records(rt: Runtime, run_dir: Path, step: int) -> None:
    """Raise the store's flag for every rank's watcher (the first rank to fail names itself), and write ours."""
    store = _store()
    try:
        if store is not None:
            store.compare_set(f"{_namespace()}/{flight.FLAG}", "", str(rt.rank))
        flight.dump(run_dir, rt.rank, reason="its collective failed", step=step)
    except (RuntimeError, dist.DistError, OSError):  # the store is gone, or the disk: the one line still comes
        pass


def watch_for_failures(rt: Runtime, run_dir: Path, step: Callable[[], int]) -> flight.Watcher | None:
    """This rank's watcher thread (observe/flight.py), where the job has a store and the recorder is on."""
    store = _store() if rt.distributed else None
    if store is None or not flight.enabled():
        return None
    return flight.Watcher(store, f"{_namespace()}/{flight.FLAG}", run_dir, rt.rank, step)


def after_restart(rt: Runtime) -> dict[str, Any] | None:
    """After torchrun restarted the group: what the previous one recorded of its failure (previous_failure,
    empty when nothing was); None for the job's first group. This machine's launcher counted the restart, or, on
    several machines, another's did (this one restarted its workers for the changed membership and counts none)
    and the group before this one left its failure record."""
    failure = previous_failure(rt)
    return failure if failure or int(_attempt()) > 0 else None


def previous_failure(rt: Runtime) -> dict[str, Any]:
    """After torchrun restarted the group: what the store holds about the failure that ended the previous
    attempt (the job's group before this one, _previous). ``rank``, ``pid``, ``exitcode`` of the worker that died
    (when its machine's launcher passed them on: scaletrain's does, plain torchrun does not); ``step``, the step
    the survivors were in; ``missing``, the ranks that never answered them. Empty for the job's first group or
    when nothing was recorded."""
    store = _store() if rt.distributed else None
    prev = _previous() if store is not None else None
    if prev is None:
        return {}
    found: dict[str, Any] = {}
    try:
        if store.check([f"{prev}/died"]):
            rank, pid, exitcode = store.get(f"{prev}/died").decode().split()
            found.update(rank=int(rank), pid=int(pid), exitcode=int(exitcode))
        if store.check([f"{prev}/failed-at"]):
            found["step"] = int(store.get(f"{prev}/failed-at"))
        if store.check([f"{prev}/missing"]):
            found["missing"] = store.get(f"{prev}/missing").decode()
    except (RuntimeError, dist.DistError, ValueError):  # a store that went away, or a value not ours
        pass
    return found


def rank0_decides(rt: Runtime, decide: Callable[[], T]) -> T:
    """Rank 0 calls ``decide``; every rank returns its result, or raises the scaletrain error it raised, marked
    ``agreed`` so that it is reported once (by rank 0), not once per rank. One broadcast of one object."""
    choice: list[Any] = [None]
    if rt.is_main:
        try:
            choice[0] = decide()
        except Reported as err:
            err.agreed = True
            choice[0] = err
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], Reported):
        raise choice[0]
    return choice[0]


def rank0_values(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank 0's values of ``tensors`` (the same list on every rank), as new tensors: one broadcast per dtype, in
    the same order on every rank. Collective: every rank of the default group calls it."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        at = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in at])
        dist.broadcast(flat, src=0)
        for i, part in zip(at, flat.split([tensors[i].numel() for i in at])):
            out[i] = part.view_as(tensors[i])
    return out


def close(rt: Runtime, *, keep: bool = False) -> None:
    """End the process group if this runtime started it (a user's own group is left alone). ``keep``: a model the
    caller holds is sharded over the group (FSDP, tensor parallelism): the group stays open until the process
    exits, so that the model can still run forward, be gathered whole (DTensor.full_tensor resolves the group
    by name: 'Could not resolve the process group' once it is destroyed) or be saved by save_pretrained.

    destroy_process_group() only drops the registry's reference. Anything else holding the group (a DDP
    wrapper, often in a reference cycle) keeps Gloo's worker threads alive until interpreter shutdown, where
    a thread releasing a finished collective's tensors needs the GIL and aborts the process ("terminate
    called without an active exception", SIGABRT, at random ~1 run in 12 here). Callers drop their
    wrappers first; collecting cycles here lets the group's destructor join its threads now. On a user's own
    group (fit() after the script's init_process_group) the same cleaning is done, so that the user's
    destroy_process_group() later finds no wrapper of ours still holding it (seen: such a job, finished, killed
    by SIGABRT at exit 2 runs in 5).
    """
    if not dist.is_initialized():
        return
    flight.stop_all()  # a watcher of a session left open holds the session, and its wrappers, alive
    if rt.owns_group and keep:  # ended at exit, before the interpreter's finalization, as a close here would
        atexit.unregister(_end_group)  # registered once, however many runs kept it
        atexit.register(_end_group)
    elif rt.owns_group:
        _end_group()
    else:
        gc.collect()


def _end_group() -> None:
    """Free what holds the group (cycles), end it, and let its destructor join Gloo's threads now."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def set_deterministic(on: bool) -> None:
    """Deterministic kernels for bitwise-repeatable runs (cuBLAS needs its workspace fixed before its first
    use; an op without a deterministic kernel warns instead of failing)."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
