"""`scaletrain cluster rehearse --nodes N --nproc P RECIPE|FILE.toml [--steps S] [--out DIR] [--section.key=value ...]`:
a multi-node job rehearsed on this machine before one is rented.

N torchrun agents on loopback (as N machines would run them, one agent each, meeting at a c10d rendezvous) start
P workers each: first the network check (scaletrain/cluster/rehearse_net.py: who is where, all-reduce bandwidth
over the world and between the nodes' first ranks), then S steps of the training job itself. What it reports is
what a real launch would show: the rendezvous, the world and where each rank is, the layout, the bandwidths, the
short run, and the command each machine would run. Two nodes of two ranks compute what one node of four does (the
same global batch, the same ranks' shards): tests/cli/test_rehearse.py holds them to 1e-6.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scaletrain.cli.options import (
    add_config_argument,
    add_config_options,
    check_types,
    config_overrides,
    load_job,
    parse_count,
)
from scaletrain.errors import TrainingFailed, UserError

HELP = "Multi-node jobs: rehearse one on this machine (N agents on loopback) before renting N machines."
_SET_HERE = ("dist.nnodes", "dist.rdzv_endpoint", "dist.rdzv_id", "train.max_steps")


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.cli.options import Parser

    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain cluster rehearse --nodes N --nproc P RECIPE|FILE.toml [--steps S] "
                             "[--out DIR] [--section.key=value ...]")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    r = verbs.add_parser("rehearse", help="a multi-node job on this machine: rendezvous, world, bandwidth, a short run",
                         description=__doc__.split("\n\n")[1], allow_abbrev=False,
                         usage="scaletrain cluster rehearse --nodes N --nproc P RECIPE|FILE.toml [--steps S] "
                               "[--out DIR] [--section.key=value ...]")
    add_config_argument(r)
    own = r.add_argument_group("rehearsal")
    own.add_argument("--nodes", default="2", help="machines to rehearse (torchrun agents here) [default: 2]")
    own.add_argument("--steps", default="20", help="optimizer steps of the short run [default: 20]")
    own.add_argument("--out", default="", help="where the logs, net.json and the run go [default: runs/rehearse]")
    add_config_options(r)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agents(commands: list[list[str]], logs: list[Path], timeout_s: float) -> list[int]:
    """Each command as one "machine's" agent, its output in its log; their exit codes. One failing stops the
    others after 30 s (a real job's survivors would time out)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    handles = [log.open("w", encoding="utf-8") for log in logs]
    procs = [subprocess.Popen(cmd, stdout=h, stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for cmd, h in zip(commands, handles)]
    deadline, failed_at = time.monotonic() + timeout_s, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 30):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                break
            time.sleep(0.2)
        return [p.wait(timeout=60) for p in procs]
    finally:
        for h in handles:
            h.close()


def _tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(encoding="utf-8", errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(text[-lines:]) or "(no output)"


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    if args.verb != "rehearse":
        raise UserError("scaletrain cluster needs a verb; fix: scaletrain cluster rehearse --nodes 2 --nproc 2 digits")
    nodes = parse_count("--nodes", args.nodes, 1, "2")
    steps = parse_count("--steps", args.steps, 1, "20")
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    nproc = parse_count("--nproc", overrides.pop("dist.nproc", "2"), 1, "2")  # workers per machine [default: 2]
    for key in _SET_HERE:
        if key in overrides:
            raise UserError(f"--{key} = {overrides[key]!r}: the rehearsal sets it (--nodes, --nproc, --steps and a "
                            "loopback rendezvous); fix: drop it")
    cfg = load_job(args.config, overrides, nproc=nproc, nnodes=nodes, endpoint="127.0.0.1:29500")
    out = Path(args.out or "runs/rehearse")
    out.mkdir(parents=True, exist_ok=True)
    job = f"rehearse-{os.getpid()}"
    me = [sys.executable, "-m", "scaletrain"]
    started = time.monotonic()

    net_port = _free_port()
    net = [[*me, "launch", "--nproc", str(nproc), "--nnodes", str(nodes), "--rdzv-endpoint", f"127.0.0.1:{net_port}",
            "--rdzv-id", f"{job}-net", "-m", "scaletrain.cluster.rehearse_net", "--out", str(out / "net.json")]
           for _ in range(nodes)]
    net_logs = [out / f"net-node{i}.log" for i in range(nodes)]
    codes = _agents(net, net_logs, timeout_s=max(120, cfg.dist.timeout_s))
    if any(codes):
        bad = next(i for i, c in enumerate(codes) if c)
        raise TrainingFailed(f"rehearsal: the network check failed on agent {bad} (exit {codes[bad]}): "
                             f"{_tail(net_logs[bad])}; its log: {net_logs[bad]}")
    netinfo = json.loads((out / "net.json").read_text())

    port = _free_port()
    passed = [f"--{k}={v}" for k, v in overrides.items() if k != "run.dir"]
    run_dir = out / "run"
    train = [[*me, "train", args.config, f"--nproc={nproc}", f"--nnodes={nodes}", f"--rdzv-endpoint=127.0.0.1:{port}",
              f"--dist.rdzv_id={job}", f"--run.dir={run_dir}", f"--train.max_steps={steps}", *passed]
             for _ in range(nodes)]
    train_logs = [out / f"train-node{i}.log" for i in range(nodes)]
    codes = _agents(train, train_logs, timeout_s=max(600, cfg.dist.timeout_s))
    if any(codes) or not (run_dir / "summary.json").exists():
        bad = next((i for i, c in enumerate(codes) if c), 0)
        raise TrainingFailed(f"rehearsal: the short run failed on agent {bad} (exit {codes[bad]}): "
                             f"{_tail(train_logs[bad])}; its log: {train_logs[bad]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    _report(args.config, nodes, nproc, steps, netinfo, summary, run_dir, passed, time.monotonic() - started, out)
    return 0


def _report(config: str, nodes: int, nproc: int, steps: int, net: dict[str, Any], summary: dict[str, Any],
            run_dir: Path, passed: list[str], took: float, out: Path) -> None:
    by_node: dict[int, list[dict[str, Any]]] = {}
    for r in net["ranks"]:
        by_node.setdefault(r["node"], []).append(r)
    lines = [(f"rehearsal: {nodes} nodes x {nproc} ranks on this machine ({nodes} torchrun agents on loopback, a c10d "
             f"rendezvous): world {net['world_size']}, {net['backend']}")]
    for node, ranks in sorted(by_node.items()):
        lines.append(f"  node {node}: ranks {', '.join(str(r['rank']) for r in ranks)} on {ranks[0]['host']} "
                     f"(pids {', '.join(str(r['pid']) for r in ranks)})")
    mib = net["size_bytes"] / 2**20
    between = net["between_nodes_busbw"]
    lines.append(f"all-reduce of {mib:g} MiB: {net['world_busbw'] / 1e9:.2f} GB/s bus bandwidth over the world"
                 + (f", {between / 1e9:.2f} GB/s between the nodes' first ranks" if between else ""))
    rate = summary.get("samples_per_s", 0.0)
    lines.append(f"short run: {summary['steps']} steps of {config}, {summary.get('strategy', 'ddp')} over "
                 f"{summary['world_size']} ranks, effective batch {summary['global_batch']}, train loss "
                 f"{summary['train_loss']:.4f}, {rate:,.0f} samples/s; run dir {run_dir}")
    command = shlex.join(["scaletrain", "train", config, f"--nproc={nproc}", f"--nnodes={nodes}",
                          "--rdzv-endpoint=FIRST_MACHINE:29500", "--dist.rdzv_id=JOB_ID", *passed])
    lines.append(f"on {nodes} real machines, run on each: {command}")
    lines.append(f"  (or under Slurm: scaletrain slurm {config} --nodes {nodes} --gpus-per-node {nproc}); "
                 f"rehearsed in {took:.0f} s; logs in {out}")
    print("\n".join(lines))
    (out / "rehearsal.json").write_text(json.dumps({"nodes": nodes, "nproc": nproc, "steps": steps, "net": net,
                                                    "summary": summary, "command": command}, indent=1))
