"""scaletrain doctor's checks on made-up facts: each classic mistake flagged once with its fix, and a healthy
setup (CPU laptop, 8-GPU node under torchrun, a Slurm job) flagged nothing."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.cluster.doctor import (
    Device,
    Facts,
    Interface,
    _cudnn_text,
    check_cuda_visible_devices,
    check_launcher_env,
    check_one_process_many_gpus,
    check_ranks_vs_gpus,
    check_socket_ifname,
    check_threads,
    diagnose,
    gather,
)

H100 = "NVIDIA H100 80GB HBM3"


def _gpus(n: int) -> tuple[Device, ...]:
    return tuple(Device(i, H100, 80 * 2**30, "9.0") for i in range(n))


def _torchrun(world: int, local: int, rank: int = 0, addr: str = "10.0.0.1") -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": addr, "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}


CPU_LAPTOP = Facts(cpu_count=8, usable_cpus=8, interfaces=(Interface("lo", ("127.0.0.1",)),
                                                           Interface("eth0", ("10.0.0.2",))))
GPU_NODE = dataclasses.replace(CPU_LAPTOP, cuda_build="12.8", nccl="2.27.3", nccl_available=True, devices=_gpus(8),
                               physical_gpus=8, cpu_count=64, usable_cpus=64,
                               interfaces=(*CPU_LAPTOP.interfaces, Interface("ib0", ("10.1.0.2",))))


def _with(base: Facts, **env: str) -> Facts:
    return dataclasses.replace(base, env=env)


def _checks(findings: list) -> list[str]:
    return [f.check for f in findings]


@pytest.mark.parametrize("facts", [
    CPU_LAPTOP,
    _with(CPU_LAPTOP, **_torchrun(world=2, local=2)),  # 2 CPU ranks, 1 thread each
    _with(GPU_NODE, **_torchrun(world=8, local=8)),
    _with(GPU_NODE, **_torchrun(world=16, local=8), NCCL_SOCKET_IFNAME="ib", GLOO_SOCKET_IFNAME="eth0"),
    # A Slurm job given 4 of the node's 8 GPUs: Slurm's CUDA_VISIBLE_DEVICES is how allocations work.
    _with(dataclasses.replace(GPU_NODE, devices=_gpus(4)), **_torchrun(world=4, local=4), SLURM_JOB_ID="42",
          CUDA_VISIBLE_DEVICES="4,5,6,7"),
    dataclasses.replace(GPU_NODE, devices=_gpus(1), physical_gpus=1),  # one GPU, one process: right
], ids=["cpu", "cpu-torchrun", "gpu-torchrun", "two-nodes", "slurm-half-node", "one-gpu"])
def test_a_healthy_setup_has_no_findings(facts: Facts) -> None:
    assert diagnose(facts) == []


def test_many_gpus_one_process_is_flagged() -> None:
    [finding] = check_one_process_many_gpus(GPU_NODE)
    assert finding.level == "warning"
    assert finding.line() == ("warning: 8 GPUs visible but this is one process (world size 1): training would use "
                              "only cuda:0 and leave 7 idle; fix: one process per GPU: scaletrain train RECIPE "
                              "--nproc 8 (or torchrun --nproc-per-node 8 train.py)")
    explicit = _with(GPU_NODE, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert _checks(diagnose(explicit)) == ["one-process", "gpus-idle"]


def test_two_ranks_per_gpu_is_an_error_and_idle_gpus_a_warning() -> None:
    two_gpus = dataclasses.replace(GPU_NODE, devices=_gpus(2), physical_gpus=2)
    [over] = check_ranks_vs_gpus(_with(two_gpus, **_torchrun(world=4, local=4)))
    assert over.level == "error" and over.check == "ranks-share-gpu"
    assert "LOCAL_WORLD_SIZE 4 on 2 GPUs: 2 more ranks than GPUs, so ranks would share a GPU" in over.message
    assert over.fix == "one rank per GPU: --nproc 2 (torchrun --nproc-per-node 2)"
    [idle] = check_ranks_vs_gpus(_with(GPU_NODE, **_torchrun(world=2, local=2)))
    assert idle.level == "warning" and "6 GPUs left idle" in idle.message and "--nproc 8" in idle.fix
    assert check_ranks_vs_gpus(_with(CPU_LAPTOP, **_torchrun(world=4, local=4))) == []  # CPU ranks: any number


@pytest.mark.parametrize(("facts", "check", "level", "text"), [
    (_with(GPU_NODE, CUDA_VISIBLE_DEVICES=""), "cvd-hides-all", "warning", "hides all 8 GPUs"),
    (_with(dataclasses.replace(GPU_NODE, devices=()), CUDA_VISIBLE_DEVICES="-1"), "cvd-hides-all", "warning",
     "hides all 8 GPUs"),
    (_with(dataclasses.replace(GPU_NODE, devices=_gpus(2)), CUDA_VISIBLE_DEVICES="0,1"), "cvd-hides", "warning",
     "shows 2 of this machine's 8 GPUs"),
    (_with(GPU_NODE, CUDA_VISIBLE_DEVICES="0,0"), "cvd-duplicate", "error", "lists GPU 0 twice"),
    (_with(CPU_LAPTOP, CUDA_VISIBLE_DEVICES="0"), "cvd-no-gpu", "warning", "this torch is a CPU build"),
    (_with(dataclasses.replace(CPU_LAPTOP, cuda_build="12.8"), CUDA_VISIBLE_DEVICES="0"), "cvd-no-gpu", "warning",
     "no NVIDIA GPU or driver"),
    (_with(dataclasses.replace(GPU_NODE, devices=()), CUDA_VISIBLE_DEVICES="8,9"), "cvd-no-gpu", "warning",
     "its ids match none of the 8 GPUs here"),
    (_with(dataclasses.replace(GPU_NODE, devices=_gpus(2), physical_gpus=2), CUDA_VISIBLE_DEVICES="0,1,2,3"),
     "cvd-invalid", "warning", "lists 4 GPUs but torch sees 2"),
])
def test_cuda_visible_devices_mistakes(facts: Facts, check: str, level: str, text: str) -> None:
    [finding] = check_cuda_visible_devices(facts)
    assert (finding.check, finding.level) == (check, level)
    assert text in finding.message and finding.fix


def test_threads_over_the_cores() -> None:
    four_cores = dataclasses.replace(CPU_LAPTOP, usable_cpus=4)
    [f] = check_threads(_with(four_cores, **{**_torchrun(world=4, local=4), "OMP_NUM_THREADS": "2"}))
    assert f.message.startswith("OMP_NUM_THREADS=2 x 4 local ranks = 8 threads on 4 usable cores")
    assert f.fix == "OMP_NUM_THREADS=1"
    [f] = check_threads(_with(four_cores, OMP_NUM_THREADS="16"))
    assert f.message.startswith("OMP_NUM_THREADS=16 threads on 4 usable cores") and f.fix == "OMP_NUM_THREADS=4"
    [f] = check_threads(_with(four_cores, OMP_NUM_THREADS="many"))
    assert f.level == "error" and f.check == "threads-invalid"
    env = _torchrun(world=2, local=2)
    del env["OMP_NUM_THREADS"]  # a launcher other than torchrun (which sets 1) left it unset
    [f] = check_threads(_with(four_cores, **env))
    assert f.check == "threads-unset" and f.fix == "OMP_NUM_THREADS=2"
    assert check_threads(_with(four_cores, **{**_torchrun(world=4, local=4), "OMP_NUM_THREADS": "1"})) == []


def test_launcher_environment_that_cannot_form_a_group() -> None:
    [f] = check_launcher_env(_with(CPU_LAPTOP, RANK="0", WORLD_SIZE="2"))
    assert f.check == "launcher-partial" and "MASTER_ADDR, MASTER_PORT not" in f.message
    [f] = check_launcher_env(_with(CPU_LAPTOP, **{**_torchrun(world=2, local=2), "RANK": "5"}))
    assert f.check == "rank-range" and "RANK 5 is outside 0..1" in f.message
    [f] = check_launcher_env(_with(GPU_NODE, **_torchrun(world=16, local=8, addr="localhost")))
    assert f.check == "master-loopback" and "spans 2 machines" in f.message
    [f] = check_launcher_env(_with(CPU_LAPTOP, **{**_torchrun(world=2, local=2), "LOCAL_RANK": "-1"}))
    assert f.check == "launcher-value" and "LOCAL_RANK='-1' in the environment is not a whole number >= 0" in f.message
    # one process: a shell's RANK=0 / WORLD_SIZE=1, or an address exported for mp.spawn, form no group to fail
    for one in ({"RANK": "0"}, {"WORLD_SIZE": "1"}, {"RANK": "0", "WORLD_SIZE": "1"}, {"MASTER_ADDR": "10.0.0.1"}):
        assert check_launcher_env(_with(CPU_LAPTOP, **one)) == [], one


def test_socket_interface_names() -> None:
    ok = [("NCCL_SOCKET_IFNAME", "eth"), ("NCCL_SOCKET_IFNAME", "=eth0"), ("NCCL_SOCKET_IFNAME", "^docker,lo"),
          ("GLOO_SOCKET_IFNAME", "lo"), ("GLOO_SOCKET_IFNAME", "eth1,eth0")]
    for var, value in ok:
        assert check_socket_ifname(_with(GPU_NODE, **{var: value})) == [], (var, value)
    [f] = check_socket_ifname(_with(GPU_NODE, NCCL_SOCKET_IFNAME="=eth"))  # '=' wants the exact name
    assert f.level == "error" and "there are: lo, eth0, ib0" in f.message
    [f] = check_socket_ifname(_with(GPU_NODE, GLOO_SOCKET_IFNAME="ens5"))
    assert f.level == "error"
    [f] = check_socket_ifname(_with(CPU_LAPTOP, NCCL_SOCKET_IFNAME="ib0"))  # no GPUs: NCCL never runs here
    assert f.level == "warning"


def test_no_gloo_or_nccl() -> None:
    assert _checks(diagnose(dataclasses.replace(CPU_LAPTOP, gloo_available=False))) == ["no-gloo"]
    assert _checks(diagnose(dataclasses.replace(GPU_NODE, devices=_gpus(1), physical_gpus=1,
                                                nccl_available=False))) == ["no-nccl"]
    assert _checks(diagnose(dataclasses.replace(CPU_LAPTOP, distributed_available=False))) == ["no-distributed"]


def test_errors_come_first() -> None:
    facts = _with(GPU_NODE, CUDA_VISIBLE_DEVICES="0,0", OMP_NUM_THREADS="128")
    assert [f.level for f in diagnose(facts)] == ["error", "warning", "warning"]


def test_gather_reads_this_machine_and_only_the_named_variables() -> None:
    facts = gather({"WORLD_SIZE": "2", "NCCL_DEBUG": "INFO", "TORCHELASTIC_RUN_ID": "x", "HOME": "/root",
                    "AWS_SECRET_ACCESS_KEY": "no", "SLURM_JOB_ID": "7"})
    assert dict(facts.env) == {"NCCL_DEBUG": "INFO", "SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "x",
                               "WORLD_SIZE": "2"}
    assert facts.python and facts.torch and facts.cpu_count >= 1 and 1 <= facts.usable_cpus <= facts.cpu_count
    assert facts.gloo_available  # every torch build this project supports has Gloo
    assert any(i.name in ("lo", "lo0") for i in facts.interfaces)


def test_cudnn_version_text() -> None:
    assert _cudnn_text(91900) == "9.19.0" and _cudnn_text(8902) == "8.9.2" and _cudnn_text(None) is None
