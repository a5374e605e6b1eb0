"""`scaletrain cluster rehearse --nodes N --nproc P RECIPE|FILE.toml [--steps S] [--out DIR] [--netns]
[--link-gbps G[,G...]] [--section.key=value ...]`:
a multi-node job rehearsed on this machine before one is rented.

N torchrun agents on loopback (as N machines would run them, one agent each, meeting at a c10d rendezvous) start
P workers each: first the network check (scaletrain/cluster/rehearse_net.py: who is where, all-reduce bandwidth
over the world and between the nodes' first ranks), then S steps of the training job itself. What it reports is
what a real launch would show: the rendezvous, the world and where each rank is, the layout, the bandwidths, the
short run, and the command each machine would run. Two nodes of two ranks compute what one node of four does (the
same global batch, the same ranks' shards): tests/cli/test_rehearse.py holds them to 1e-6.

With --netns (or --link-gbps G[,G...]) each agent runs in a network namespace of its own (cluster/netns.py), with
its own address, host name and link speed: the job then binds and talks as it would between machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
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
    out_dir,
    parse_count,
)
from scaletrain.cluster import netns
from scaletrain.errors import TrainingFailed, UserError

HELP = ("Multi-node jobs: rehearse one on this machine (N agents on loopback, or in network namespaces) before "
        "renting N machines.")
USAGE = ("scaletrain cluster rehearse --nodes N --nproc P RECIPE|FILE.toml [--steps S] [--out DIR] [--netns] "
         "[--link-gbps G[,G...]] [--section.key=value ...]")
_SET_HERE = ("dist.nnodes", "dist.rdzv_endpoint", "dist.rdzv_id", "dist.local_addr", "train.max_steps")


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.cli.options import Parser

    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False, usage=USAGE)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    r = verbs.add_parser("rehearse", help="a multi-node job on this machine: rendezvous, world, bandwidth, a short run",
                         description=__doc__.split("\n\n")[1], allow_abbrev=False, usage=USAGE)
    add_config_argument(r)
    own = r.add_argument_group("rehearsal")
    own.add_argument("--nodes", default="2", help="machines to rehearse (torchrun agents here) [default: 2]")
    own.add_argument("--steps", default="20", help="optimizer steps of the short run [default: 20]")
    own.add_argument("--out", default="", help="where the logs, net.json and the run go [default: runs/rehearse]")
    own.add_argument("--netns", action="store_true",
                     help="each node in a network namespace of its own, on a bridge, instead of loopback (needs root)")
    own.add_argument("--link-gbps", default="", metavar="G[,G...]",
                     help="each node's link speed in Gbit/s: one for all, or one per node; implies --netns")
    add_config_options(r)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agents(commands: list[list[str]], logs: list[Path], timeout_s: float, drop: tuple[str, ...] = ()) -> list[int]:
    """Each command as one "machine's" agent, its output in its log; their exit codes. One failing stops the
    others after 30 s (a real job's survivors would time out). ``drop``: variables of this machine the agents
    must not inherit."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *drop)}
    handles = [log.open("w", encoding="utf-8") for log in logs]
    procs = [subprocess.Popen(cmd, stdout=h, stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for cmd, h in zip(commands, handles)]
    deadline, failed_at = time.monotonic() + timeout_s, None
    stopped = signal.signal(signal.SIGTERM, _as_interrupt)
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 30):
                break
            time.sleep(0.2)
        _stop(procs)  # past the deadline, or 30 s after one failed: the rest
        return [p.returncode for p in procs]
    except BaseException:  # Ctrl-C or SIGTERM: the agents run in sessions of their own, so stop them here
        _stop(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, stopped)
        for h in handles:
            h.close()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the agents still running, each given 60 s to stop its workers before it is killed."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: the agents are stopped and the namespaces removed on the way out."""
    raise KeyboardInterrupt


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
    speeds = _speeds(args.link_gbps, nodes)
    isolated = args.netns or bool(speeds)
    if isolated and (why := netns.unavailable(shaped=bool(speeds))):
        raise UserError(f"--netns: {why}; fix: run the rehearsal as root on Linux, or drop --netns and "
                        "--link-gbps to rehearse on loopback")
    host = f"{netns.SUBNET}.1" if isolated else "127.0.0.1"
    cfg = load_job(args.config, overrides, nproc=nproc, nnodes=nodes, endpoint=f"{host}:29500")
    out = Path(args.out or "runs/rehearse")
    if (out / "run" / "summary.json").exists():  # said now, not after the network check
        raise UserError(f"--out = {str(out)!r}: holds a finished rehearsal ({out / 'run' / 'summary.json'}); fix: "
                        f"--out={out}-2, or remove {out} first")
    out_dir(out, "--out", "runs/rehearse")
    with netns.namespaces(nodes, speeds) if isolated else contextlib.nullcontext([]) as where:
        return _rehearse(args.config, cfg, overrides, nodes, nproc, steps, out, where, speeds)


def _speeds(text: str, nodes: int) -> list[float]:
    """--link-gbps: each node's link speed in Gbit/s, from one for all or one per node ([] when not given)."""
    if not text:
        return []
    try:
        speeds = [float(part) for part in text.split(",")]
    except ValueError:
        speeds = []
    if not speeds or not all(0 < g < 1e4 for g in speeds) or len(speeds) not in (1, nodes):
        raise UserError(f"--link-gbps = {text!r}: expected Gbit/s above 0, one for every node or one for each of "
                        f"the {nodes} (comma-separated); fix: --link-gbps=1 or --link-gbps={','.join(['1'] * nodes)}")
    return speeds * nodes if len(speeds) == 1 else speeds


def _rehearse(config: str, cfg: Any, overrides: dict[str, str], nodes: int, nproc: int, steps: int, out: Path,
              where: list[netns.Node], speeds: list[float]) -> int:
    """The network check, then the short run, each as ``nodes`` agents: on loopback, or each agent inside its
    node's namespace (``where``), given that node's address for its stores and sockets."""
    job = f"rehearse-{os.getpid()}"
    me = [sys.executable, "-m", "scaletrain"]
    started = time.monotonic()
    # This machine's interface names mean nothing inside a namespace: the agents' launchers pick the interface
    # holding the node's address (--local-addr) themselves.
    drop = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if where else ()

    def agent(i: int, command: list[str]) -> list[str]:
        """Node i's agent: on loopback as is, or inside its namespace."""
        return where[i].run(command) if where else command

    def own(i: int, option: str) -> list[str]:
        """Node i's address as ``option``, under --netns (on loopback the launcher binds 127.0.0.1 itself)."""
        return [f"{option}={where[i].address}"] if where else []

    net_port = 29400 if where else _free_port()  # a fresh namespace has every port free
    # 16 MiB per all-reduce, or what the slowest link carries in about 0.1 s (a shaped link's rate is exact)
    mib = min(16.0, max(0.25, round(min(speeds) * 1e9 / 8 * 0.1 / 2**20 * 4) / 4)) if speeds else 16.0
    host = where[0].address if where else "127.0.0.1"
    net = [agent(i, [*me, "launch", "--nproc", str(nproc), "--nnodes", str(nodes), "--rdzv-endpoint",
                     f"{host}:{net_port}", *own(i, "--local-addr"), "--rdzv-id", f"{job}-net",
                     "-m", "scaletrain.cluster.rehearse_net", "--out", str(out / "net.json"), "--mb", f"{mib:g}"])
           for i in range(nodes)]
    net_logs = [out / f"net-node{i}.log" for i in range(nodes)]
    codes = _agents(net, net_logs, timeout_s=max(120, cfg.dist.timeout_s), drop=drop)
    if any(codes):
        bad = _first_cause(codes, net_logs)
        raise TrainingFailed(f"rehearsal: the network check failed on agent {bad} (exit {codes[bad]}): "
                             f"{_tail(net_logs[bad])}; its log: {net_logs[bad]}")
    netinfo = json.loads((out / "net.json").read_text())

    port = 29500 if where else _free_port()
    passed = [f"--{k}={v}" for k, v in overrides.items() if k != "run.dir"]
    run_dir = out / "run"
    train = [agent(i, [*me, "train", config, f"--nproc={nproc}", f"--nnodes={nodes}",
                       f"--rdzv-endpoint={host}:{port}", *own(i, "--dist.local_addr"), f"--dist.rdzv_id={job}",
                       f"--run.dir={run_dir}", f"--train.max_steps={steps}", *passed])
             for i in range(nodes)]
    train_logs = [out / f"train-node{i}.log" for i in range(nodes)]
    codes = _agents(train, train_logs, timeout_s=max(600, cfg.dist.timeout_s), drop=drop)
    if any(codes) or not (run_dir / "summary.json").exists():
        bad = _first_cause(codes, train_logs)
        raise TrainingFailed(f"rehearsal: the short run failed on agent {bad} (exit {codes[bad]}): "
                             f"{_tail(train_logs[bad])}; its log: {train_logs[bad]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    links = [{"node": n.index, "host": n.hostname, "address": n.address, "gbps": speeds[n.index] if speeds else None}
             for n in where]
    warned = [line.strip() for line in train_logs[0].read_text(errors="replace").splitlines()
              if line.startswith("scaletrain: warning:")]
    _report(config, nodes, nproc, steps, netinfo, summary, run_dir, passed, time.monotonic() - started, out,
            f"{host}:{port}", links, warned)
    return 0


def _report(config: str, nodes: int, nproc: int, steps: int, net: dict[str, Any], summary: dict[str, Any],
            run_dir: Path, passed: list[str], took: float, out: Path, endpoint: str, links: list[dict[str, Any]],
            warned: list[str]) -> None:
    by_node: dict[int, list[dict[str, Any]]] = {}
    for r in net["ranks"]:
        by_node.setdefault(r["node"], []).append(r)
    if links:
        speeds = sorted({link["gbps"] for link in links if link["gbps"]})
        how = (f"{nodes} torchrun agents, each in a network namespace of its own, on a bridge{_links(speeds)}, "
               f"a c10d rendezvous at {endpoint}")
    else:
        how = f"{nodes} torchrun agents on loopback, a c10d rendezvous"
    lines = [(f"rehearsal: {nodes} nodes x {nproc} ranks on this machine ({how}): world {net['world_size']}, "
              f"{net['backend']}")]
    for node, ranks in sorted(by_node.items()):
        link = links[node] if links else None  # by node index
        at = f" at {link['address']}" + (f", a {link['gbps']:g} Gbit/s link" if link["gbps"] else "") if link else ""
        lines.append(f"  node {node}: ranks {', '.join(str(r['rank']) for r in ranks)} on {ranks[0]['host']}{at} "
                     f"(pids {', '.join(str(r['pid']) for r in ranks)})")
    mib = net["size_bytes"] / 2**20
    between = net["between_nodes_busbw"]
    lines.append(f"all-reduce of {mib:g} MiB: {net['world_busbw'] / 1e9:.3f} GB/s bus bandwidth over the world"
                 + (f", {between / 1e9:.3f} GB/s between the nodes' first ranks" if between else ""))
    from scaletrain.observe.throughput import per_second

    rate = summary.get("samples_per_s") or 0.0
    lines.append(f"short run: {summary['steps']} steps of {config}, {summary.get('strategy', 'ddp')} over "
                 f"{summary['world_size']} ranks, effective batch {summary['global_batch']}, train loss "
                 f"{summary['train_loss']:.4f}, {per_second(rate)} samples/s; run dir {run_dir}")
    lines += [f"  it warned: {line.removeprefix('scaletrain: warning: ')}" for line in warned]
    command = shlex.join(["scaletrain", "train", config, f"--nproc={nproc}", f"--nnodes={nodes}",
                          "--rdzv-endpoint=FIRST_MACHINE:29500", "--dist.rdzv_id=JOB_ID", *passed])
    lines.append(f"on {nodes} real machines, run on each: {command}")
    lines.append(f"  (or under Slurm: scaletrain slurm {config} --nodes {nodes} --gpus-per-node {nproc}); "
                 f"rehearsed in {took:.0f} s; logs in {out}")
    print("\n".join(lines))
    (out / "rehearsal.json").write_text(json.dumps({"nodes": nodes, "nproc": nproc, "steps": steps, "net": net,
                                                    "summary": summary, "command": command, "links": links},
                                                   indent=1))


def _links(speeds: list[float]) -> str:
    if not speeds:
        return ""
    return f", links of {speeds[0]:g} Gbit/s" if len(speeds) == 1 else \
        f", links of {' to '.join(f'{g:g}' for g in (speeds[0], speeds[-1]))} Gbit/s"


def _first_cause(codes: list[int], logs: list[Path]) -> int:
    """The agent to name when the rehearsal failed: one whose worker was killed by a signal (the others only
    lost a peer: their "rank 0 failed" is the consequence), else the first that failed, else agent 0."""
    failed = [i for i, c in enumerate(codes) if c]
    for i in failed:
        with contextlib.suppress(OSError):
            if "was killed by " in logs[i].read_text(errors="replace"):
                return i
    return failed[0] if failed else 0
