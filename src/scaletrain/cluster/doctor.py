"""`scaletrain doctor`'s facts, checks and self-test.

The checks are pure functions of a ``Facts`` value, so every classic mistake can be tested on made-up facts
(eight GPUs, a Slurm job, a launcher's variables) on a machine that has none of them. ``gather()`` is the
only part that looks at this machine; ``self_test()`` is the only part that starts processes.

Run as a module (``python -m scaletrain.cluster.doctor OUT.json``) it is the self-test's worker: torchrun
starts it on every rank through ``scaletrain.cluster.torchrun.launch``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

# What a bug report needs from the environment: the launcher's variables, the devices' visibility, the
# backends' settings, the thread count. Nothing else is read (and so nothing private is printed).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
              "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_STEP_ID", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
              "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
OTHER_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "TORCH_DISTRIBUTED_DEBUG", "LOGLEVEL")
PREFIXES = ("TORCHELASTIC_", "NCCL_", "TORCH_NCCL_", "GLOO_")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_bytes: int
    capability: str  # "9.0"


@dataclass(frozen=True)
class Interface:
    name: str
    ipv4: tuple[str, ...] = ()


@dataclass(frozen=True)
class Facts:
    """Everything the checks look at; made by gather(), or by hand in a test."""

    hostname: str = "host"
    platform: str = ""
    python: str = ""
    torch: str = ""
    cuda_build: str | None = None  # torch.version.cuda: None for a CPU build
    cudnn: str | None = None
    nccl: str | None = None
    distributed_available: bool = True
    gloo_available: bool = True
    nccl_available: bool = False
    devices: tuple[Device, ...] = ()  # the GPUs torch sees (after CUDA_VISIBLE_DEVICES)
    physical_gpus: int | None = None  # the GPUs the NVIDIA driver knows on this machine; None: unknown
    cpu_count: int = 1
    usable_cpus: int = 1  # this process's CPU affinity (Slurm's --cpus-per-task, taskset)
    env: Mapping[str, str] = field(default_factory=dict)  # the variables above that are set
    interfaces: tuple[Interface, ...] = ()


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning"]  # error: this setup cannot work; warning: it works, worse than it could
    check: str
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.level}: {self.message}; fix: {self.fix}"


# ---------------------------------------------------------------------------------------------- the facts


def _ipv4(name: str) -> tuple[str, ...]:
    """The interface's IPv4 address (Linux ioctl SIOCGIFADDR); () where unknown or not Linux."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return (socket.inet_ntoa(packed[20:24]),)
    except (OSError, ImportError):
        return ()


def _physical_gpus() -> int | None:
    """GPUs the NVIDIA driver lists, whatever CUDA_VISIBLE_DEVICES says (None without the driver's /proc)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else None


def _cudnn_text(version: int | None) -> str | None:
    """cuDNN's integer as a version: 91900 -> 9.19.0 (cuDNN 9 counts minor x 100), 8902 -> 8.9.2."""
    if not version:
        return None
    if version >= 10000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def _env(environ: Mapping[str, str]) -> dict[str, str]:
    names = set(TORCHRUN_VARS + SLURM_VARS + OTHER_VARS)
    return {k: environ[k] for k in sorted(environ) if k in names or k.startswith(PREFIXES)}


def gather(environ: Mapping[str, str] | None = None) -> Facts:
    """The facts of this machine and process."""
    environ = os.environ if environ is None else environ
    devices: tuple[Device, ...] = ()
    nccl = cudnn = None
    if torch.cuda.is_available():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        devices = tuple(Device(i, p.name, int(p.total_memory), f"{p.major}.{p.minor}") for i, p in enumerate(props))
        cudnn = _cudnn_text(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (RuntimeError, AttributeError):
            nccl = None
    available = dist.is_available()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    try:
        interfaces = tuple(Interface(name, _ipv4(name)) for _, name in socket.if_nameindex())
    except OSError:
        interfaces = ()
    return Facts(
        hostname=socket.gethostname(), platform=platform.platform(), python=platform.python_version(),
        torch=torch.__version__, cuda_build=torch.version.cuda, cudnn=cudnn, nccl=nccl,
        distributed_available=available, gloo_available=available and dist.is_gloo_available(),
        nccl_available=available and dist.is_nccl_available(), devices=devices, physical_gpus=_physical_gpus(),
        cpu_count=os.cpu_count() or 1, usable_cpus=usable, env=_env(environ), interfaces=interfaces)


# ---------------------------------------------------------------------------------------------- the checks


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _under_launcher(f: Facts) -> bool:
    from scaletrain.env import under_launcher

    return under_launcher(f.env)


def _local_ranks(f: Facts) -> int:
    """Processes of this job on this machine: the launcher's word, else this one process."""
    if not _under_launcher(f):
        return 1
    return _int(f.env, "LOCAL_WORLD_SIZE") or _int(f.env, "SLURM_NTASKS_PER_NODE") or _int(f.env, "WORLD_SIZE") or 1


def check_one_process_many_gpus(f: Facts) -> list[Finding]:
    """The seeds' "only one GPU is being used": launched as `python train.py` on a multi-GPU machine."""
    gpus, world = len(f.devices), _int(f.env, "WORLD_SIZE") or 1
    if gpus < 2 or world > 1:
        return []
    return [Finding("warning", "one-process", f"{gpus} GPUs visible but this is one process (world size 1): "
                    f"training would use only cuda:0 and leave {gpus - 1} idle",
                    f"one process per GPU: scaletrain train RECIPE --nproc {gpus} (or torchrun "
                    f"--nproc-per-node {gpus} train.py)")]


def check_cuda_visible_devices(f: Facts) -> list[Finding]:
    """CUDA_VISIBLE_DEVICES hiding GPUs, naming none that exist, or set where torch sees no GPU at all."""
    value = f.env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return []
    ids = [x.strip() for x in value.split(",") if x.strip()]
    shown, physical = len(f.devices), f.physical_gpus
    var = f"CUDA_VISIBLE_DEVICES={value!r}"
    if not ids or ids[0] in ("-1", "none", "NoDevFiles"):
        if physical:
            return [Finding("warning", "cvd-hides-all", f"{var} hides all {physical} GPUs of this machine: "
                            "training runs on the CPU", "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use "
                            "(e.g. 0,1)")]
        return []
    if len(set(ids)) < len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        return [Finding("error", "cvd-duplicate", f"{var} lists GPU {dup} twice (CUDA then fails to initialise)",
                        "list each GPU once")]
    if shown == 0:
        if f.cuda_build is None:
            why, fix = "this torch is a CPU build", "install a CUDA build of torch, or unset CUDA_VISIBLE_DEVICES"
        elif not physical:
            why, fix = "no NVIDIA GPU or driver was found on this machine", \
                "run on a machine with GPUs, or unset CUDA_VISIBLE_DEVICES"
        else:
            why, fix = f"its ids match none of the {physical} GPUs here", \
                f"use ids 0..{physical - 1} (or the UUIDs nvidia-smi -L prints)"
        return [Finding("warning", "cvd-no-gpu", f"{var} is set but torch sees no GPU: {why}", fix)]
    if len(ids) > shown:
        return [Finding("warning", "cvd-invalid", f"{var} lists {len(ids)} GPUs but torch sees {shown} (CUDA "
                        "stops at the first id that names no GPU)", f"list only existing GPUs: ids 0.."
                        f"{(physical or shown) - 1}")]
    if physical and shown < physical and "SLURM_JOB_ID" not in f.env:
        # Under Slurm the job's allocation sets it: hiding the other jobs' GPUs is the point.
        return [Finding("warning", "cvd-hides", f"{var} shows {shown} of this machine's {physical} GPUs",
                        "right if other jobs use the rest; otherwise unset CUDA_VISIBLE_DEVICES to use all "
                        f"{physical}")]
    return []


def check_ranks_vs_gpus(f: Facts) -> list[Finding]:
    """Under a launcher on GPUs: one rank per GPU. More ranks share GPUs (NCCL refuses); fewer leave GPUs idle."""
    gpus = len(f.devices)
    if not _under_launcher(f) or gpus == 0:
        return []
    local = _local_ranks(f)
    what = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in f.env else "world size"
    if local > gpus:
        return [Finding("error", "ranks-share-gpu", f"{what} {local} on {gpus} GPU{'s' * (gpus > 1)}: "
                        f"{local - gpus} more rank{'s' * (local - gpus > 1)} than GPUs, so ranks would share a GPU (NCCL "
                        "stops with 'Duplicate GPU detected')",
                        f"one rank per GPU: --nproc {gpus} (torchrun --nproc-per-node {gpus})")]
    if local < gpus:
        return [Finding("warning", "gpus-idle", f"{what} {local} on {gpus} GPUs: {gpus - local} GPU"
                        f"{'s' * (gpus - local > 1)} left idle", f"--nproc {gpus} (torchrun --nproc-per-node "
                        f"{gpus}), or CUDA_VISIBLE_DEVICES to hide the GPUs you do not mean to use")]
    return []


def check_launcher_env(f: Facts) -> list[Finding]:
    """Half a launcher's environment (a script exporting RANK but not WORLD_SIZE) hangs or crashes at init."""
    from scaletrain.env import launcher_env_problem

    env, out = f.env, []
    problem = launcher_env_problem(env)
    if problem is not None:
        out.append(Finding("error", *problem))
    world = _int(env, "WORLD_SIZE")
    local = _int(env, "LOCAL_WORLD_SIZE")
    if world and local and world > local and env.get("MASTER_ADDR") in _LOOPBACK:
        out.append(Finding("error", "master-loopback", f"MASTER_ADDR={env['MASTER_ADDR']} but the job spans "
                           f"{world // local} machines (WORLD_SIZE {world}, {local} per machine): the others "
                           "cannot reach this machine's loopback", "a host name or address of the first machine "
                           "that all machines can reach (--rdzv-endpoint node0:29500)"))
    return out


def check_threads(f: Facts) -> list[Finding]:
    """OMP_NUM_THREADS x local ranks over the cores: every rank's threads fight for them, all ranks slow down."""
    local, cpus = _local_ranks(f), f.usable_cpus
    fair = max(1, cpus // local)
    value = f.env.get("OMP_NUM_THREADS")
    if value is None:
        if local > 1:
            return [Finding("warning", "threads-unset", f"OMP_NUM_THREADS unset with {local} ranks on this "
                            f"machine: each uses all {cpus} cores ({local * cpus} threads)",
                            f"OMP_NUM_THREADS={fair}")]
        return []
    threads = int(value) if value.strip().isdigit() else 0
    if threads < 1:
        return [Finding("error", "threads-invalid", f"OMP_NUM_THREADS={value!r} is not a positive integer",
                        f"OMP_NUM_THREADS={fair}")]
    if threads * local > cpus:
        total = f" x {local} local ranks = {threads * local} threads" if local > 1 else " threads"
        return [Finding("warning", "threads-oversubscribed", f"OMP_NUM_THREADS={threads}{total} on {cpus} usable "
                        "cores: oversubscribed, every rank slows down", f"OMP_NUM_THREADS={fair}")]
    return []


def check_backends(f: Facts) -> list[Finding]:
    if not f.distributed_available:
        return [Finding("error", "no-distributed", "this torch was built without torch.distributed: no "
                        "multi-process training", "install a torch build from pytorch.org")]
    out = []
    if not f.gloo_available:
        out.append(Finding("error", "no-gloo", "this torch has no Gloo backend: CPU ranks cannot talk",
                           "install a torch build from pytorch.org"))
    if f.devices and not f.nccl_available:
        out.append(Finding("warning", "no-nccl", f"{len(f.devices)} GPU(s) but no NCCL in this torch: GPU ranks "
                           "would fall back to Gloo, far slower", "install torch's CUDA build for Linux, "
                           "which ships NCCL"))
    return out


def _ifname_matches(var: str, value: str, names: list[str]) -> bool:
    """NCCL: a comma list of name prefixes, '=' for exact names, '^' to exclude; Gloo: a comma list of names."""
    items = [x.strip() for x in value.split(",") if x.strip()]
    if var.startswith("NCCL"):
        if value.startswith("^"):
            return True  # an exclusion list leaves the rest; nothing to name
        if value.startswith("="):
            return any(x.lstrip("=") in names for x in items)
        return any(n.startswith(x) for x in items for n in names)
    return any(x in names for x in items)


def ifname_problem(var: str, value: str | None, names: list[str]) -> tuple[str, str] | None:
    """(what is wrong, the fix) when ``var`` (NCCL_/GLOO_SOCKET_IFNAME) set to ``value`` names none of this
    machine's interfaces ``names``; None when it is unset, matches, or there is nothing to match against."""
    if value is None or not names or _ifname_matches(var, value, names):
        return None
    return (f"{var}={value!r} matches no network interface here (there are: {', '.join(names)})",
            f"name the interface that reaches the other machines, or unset {var}")


def check_socket_ifname(f: Facts) -> list[Finding]:
    """An interface name that matches nothing here: the backend cannot bind, or the job hangs at start."""
    names = [i.name for i in f.interfaces]
    out = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if problem := ifname_problem(var, f.env.get(var), names):
            # NCCL's setting only bites where NCCL runs: on a machine without GPUs it is a stray, not a stop.
            level: Literal["error", "warning"] = "warning" if var.startswith("NCCL") and not f.devices else "error"
            out.append(Finding(level, "ifname", *problem))
    return out


CHECKS = (check_backends, check_one_process_many_gpus, check_cuda_visible_devices, check_ranks_vs_gpus,
          check_launcher_env, check_threads, check_socket_ifname)


def diagnose(f: Facts) -> list[Finding]:
    """Every check's findings, errors first."""
    found = [x for check in CHECKS for x in check(f)]
    return sorted(found, key=lambda x: x.level != "error")


def facts_dict(f: Facts) -> dict[str, Any]:
    return {**asdict(f), "env": dict(f.env)}


# ---------------------------------------------------------------------------------------------- the self-test

SELF_TEST_RANKS = 2
_PATTERN = 1000  # rank r contributes arange(n) + r * _PATTERN: the sum is exact in float32 for these sizes


def _expected(n: int, world: int) -> torch.Tensor:
    return world * torch.arange(n, dtype=torch.float32) + _PATTERN * world * (world - 1) / 2


def self_test_body(timeout_s: float = 60.0) -> dict[str, Any] | None:
    """On every rank of a launched group: all-reduce, check the sum, time a bandwidth loop.

    Returns the result on rank 0 (None on the others). Joins the launcher's group and leaves it destroyed.
    NCCL where each local rank has its own GPU, else Gloo on the CPU.
    """
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_gpu = dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device if on_gpu else None)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        n = 4096
        x = torch.arange(n, dtype=torch.float32, device=device) + rank * _PATTERN
        dist.all_reduce(x)
        correct = bool(torch.equal(x.cpu(), _expected(n, world)))
        ok = torch.tensor([1 if correct else 0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank's verdict, not only rank 0's

        size = (64 if on_gpu else 8) * 2**20  # bytes: large enough that bandwidth, not latency, dominates
        iters = 20 if on_gpu else 5
        buf = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connection set-up and allocator
            dist.all_reduce(buf)
        if on_gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        if on_gpu:
            torch.cuda.synchronize(device)  # host-device sync: the collectives are asynchronous on GPU
        per_op = (time.perf_counter() - started) / iters
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        if rank != 0:
            return None
        # With one rank nothing crosses a link: the "all-reduce" is a local no-op, its speed no bandwidth.
        algbw = size / per_op / 1e9 if world > 1 else None
        return {"ok": bool(ok.item()), "world_size": world, "backend": backend, "device": device.type,
                "hosts": hosts, "check": f"sum over {world} ranks of arange({n}) + rank x {_PATTERN}",
                "result_correct_on_all_ranks": bool(ok.item()), "bytes": size, "iters": iters,
                "seconds_per_op": per_op, "algbw_gb_per_s": algbw,
                # nccl-tests' bus bandwidth: what each link carries in a ring all-reduce, comparable across sizes.
                "busbw_gb_per_s": algbw * 2 * (world - 1) / world if algbw is not None else None}
    finally:
        dist.destroy_process_group()


def self_test(under_launcher: bool) -> dict[str, Any] | None:
    """The all-reduce self-test. Under a launcher: across the launcher's whole world (the real network);
    otherwise: SELF_TEST_RANKS local ranks started through torchrun's API on loopback.
    Returns the result on the process that reports it (None on the other ranks of a launched job)."""
    from scaletrain.cluster.forked import serial_launcher
    from scaletrain.cluster.torchrun import launch
    from scaletrain.config import DistConfig

    if under_launcher:
        return self_test_body()
    serial_launcher()  # the doctor has computed nothing: its ranks may be forks of it (cluster/forked.py)
    with tempfile.TemporaryDirectory(prefix="scaletrain-doctor-") as tmp:
        out = Path(tmp) / "result.json"
        code = launch(DistConfig(nproc=SELF_TEST_RANKS), ["scaletrain.cluster.doctor", str(out)], module=True,
                      run_id="scaletrain-doctor")
        if code != 0 or not out.is_file():
            return {"ok": False, "world_size": SELF_TEST_RANKS,
                    "error": f"the self-test's workers failed (exit {code}); their output is above"}
        return json.loads(out.read_text(encoding="utf-8"))


def _worker_main(out: str) -> int:
    result = self_test_body()
    if result is not None:
        Path(out).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
