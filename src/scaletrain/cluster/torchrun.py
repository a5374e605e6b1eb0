"""Starting workers through torchrun's own API (torch.distributed.run), never a home-made spawner."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from scaletrain.config import DistConfig


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def _is_local(endpoint: str) -> bool:
    return not endpoint or endpoint.rpartition(":")[0] in ("127.0.0.1", "localhost", "::1", "[::1]")


def torchrun_args(cfg: DistConfig, target: list[str], *, module: bool, run_id: str) -> list[str]:
    """torchrun's options for this machine's workers and the script (or module) ``target[0]``."""
    args = [f"--nproc-per-node={cfg.nproc}", f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint or '127.0.0.1:0'}", f"--rdzv-id={cfg.rdzv_id or run_id}",
            f"--max-restarts={cfg.max_restarts}"]
    if _is_local(cfg.rdzv_endpoint):
        args.append("--local-addr=127.0.0.1")
    return args + (["-m"] if module else []) + target[:1]


def launch(cfg: DistConfig, target: list[str], *, module: bool = False, run_id: str = "") -> int:
    """Start cfg.nproc workers on this machine and wait for them; returns the job's exit code.

    On one machine everything stays on loopback: the rendezvous store, and Gloo's sockets
    (GLOO_SOCKET_IFNAME), which would otherwise bind the address the host name resolves to.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if _is_local(cfg.rdzv_endpoint) and (lo := _loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    # torchrun would set 1 and print a banner about it; on CPUs give each worker its share of the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    parsed = torchrun.get_args_parser().parse_args(
        torchrun_args(cfg, target, module=module, run_id=run_id or f"scaletrain-{uuid.uuid4().hex[:8]}"))
    # Set, not parsed: torchrun's parser would read the script's own --options (abbreviations included).
    parsed.training_script_args = target[1:]
    try:
        torchrun.run(parsed)
    except ChildFailedError as err:
        codes = sorted({f.exitcode for f in err.failures.values()})
        first = min(err.failures.items())
        print(f"scaletrain: worker rank {first[0]} failed with exit code {first[1].exitcode} "
              f"(all failed codes: {codes})", file=sys.stderr)
        return 2 if codes == [2] else 1
    return 0
