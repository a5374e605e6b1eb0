"""`scaletrain doctor [--self-test/--no-self-test] [--json]`: this machine's setup for a bug report, the
classic mistakes flagged one line each with the fix, and a 2-rank all-reduce self-test.

`scaletrain doctor --nodes N --rdzv-endpoint HOST:PORT [--nproc G] [--json]`, run on each of N machines: the
pairwise bandwidth between them (cluster/pairwise.py), naming a slow node or link."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from scaletrain.errors import EXIT_FAILURE, EXIT_OK, UserError

HELP = "Report versions, devices, launcher/Slurm/NCCL settings and network; flag classic mistakes; self-test."
USAGE = ("scaletrain doctor [--self-test/--no-self-test] [--json] | scaletrain doctor --nodes N --rdzv-endpoint "
         "HOST:PORT [--nproc G] [--json]")


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP + " Exit code 1 when the self-test fails or a finding "
                       "is an error (a setup that cannot work). Under torchrun it reports once per machine and "
                       "self-tests the launcher's whole world. With --nodes N, run on each of N machines: the "
                       "bandwidth between every two of them instead (exit code 1 when a node or link is slow).",
                       usage=USAGE, allow_abbrev=False)
    p.add_argument("--self-test", action=argparse.BooleanOptionalAction, default=True,
                   help="run a 2-rank all-reduce (Gloo on CPU, NCCL with 2+ GPUs): result checked, bandwidth "
                   "measured [default: on]")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    nodes = p.add_argument_group("between machines (run the same command on each)")
    nodes.add_argument("--nodes", default=None, metavar="N",
                       help="machines in the check: each one's first rank exchanges 16 MiB both ways with every "
                       "other's, in rounds of disjoint pairs; a node or link below half its peers' median is named")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="where the machines meet (a port free on the first machine)")
    nodes.add_argument("--nproc", default=None, metavar="G", help="workers per machine (one per GPU) [default: 1]")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _print(facts: Any, findings: list[Any], result: dict[str, Any] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    table = Table(title=f"scaletrain doctor: {facts.hostname}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("platform", facts.platform)
    table.add_row("versions", f"python {facts.python} | torch {facts.torch} | CUDA {facts.cuda_build or '-'} | "
                  f"cuDNN {facts.cudnn or '-'} | NCCL {facts.nccl or '-'}")
    table.add_row("backends", " | ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in
                                         (("distributed", facts.distributed_available),
                                          ("gloo", facts.gloo_available), ("nccl", facts.nccl_available))))
    gpus = [f"cuda:{d.index} {d.name} ({_gib(d.total_bytes)}, sm {d.capability})" for d in facts.devices]
    physical = f" (the driver lists {facts.physical_gpus})" if facts.physical_gpus is not None else ""
    table.add_row("GPUs", ("\n".join(gpus) if gpus else "none seen by torch") + physical)
    table.add_row("CPU", f"{facts.cpu_count} cores, {facts.usable_cpus} usable by this process")
    table.add_row("network", "\n".join(f"{i.name} {' '.join(i.ipv4)}".strip() for i in facts.interfaces) or "-")
    for key, value in facts.env.items():
        table.add_row(key, value)
    if not facts.env:
        table.add_row("environment", "no launcher, Slurm, CUDA_VISIBLE_DEVICES, NCCL_/GLOO_ or thread variables set")
    console.print(table)
    for finding in findings:
        console.print(finding.line(), markup=False)
    if not findings:
        console.print("no problems found", markup=False)
    if result is None:
        return
    if result.get("error"):
        console.print(f"self-test: FAILED: {result['error']}", markup=False)
        return
    verdict = "result correct on all ranks" if result["ok"] else "WRONG RESULT on at least one rank"
    speed = "one rank: no link to measure" if result["algbw_gb_per_s"] is None else (
        f"{result['bytes'] / 2**20:.0f} MiB in {result['seconds_per_op'] * 1e3:.2f} ms: "
        f"{result['algbw_gb_per_s']:.2f} GB/s algorithm bandwidth, {result['busbw_gb_per_s']:.2f} GB/s bus bandwidth")
    ranks = f"{result['world_size']} rank{'s' * (result['world_size'] != 1)}"
    console.print(f"self-test: all-reduce over {ranks} ({result['backend']}, {result['device']}, hosts "
                  f"{', '.join(sorted(set(result['hosts'])))}): {verdict}; {speed}", markup=False)


def _print_nodes(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    nodes = result["nodes"]
    table = Table(title=f"pairwise bandwidth, GB/s each way ({result['size_bytes'] / 2**20:.0f} MiB both ways at "
                  f"once, median of {result['iters']}; {result['backend']}, {result['device']})", title_justify="left")
    table.add_column("node")
    for node in nodes:
        table.add_column(str(node["node"]), justify="right")
    for node, row in zip(nodes, result["bytes_per_s"]):
        table.add_row(f"{node['node']} {node['host']}", *("-" if bw is None else f"{bw / 1e9:.2f}" for bw in row))
    console.print(table)
    for line in result["lines"]:
        console.print(line, markup=False)


def _run_nodes(args: argparse.Namespace) -> int:
    """The check between machines: this machine's part of it, its report, exit code 1 when a node or link is
    slow (a gate before a long job: scaletrain doctor --nodes 4 ... && scaletrain train ...)."""
    from scaletrain.cli.options import parse_count
    from scaletrain.cluster.pairwise import run_check
    from scaletrain.config import build
    from scaletrain.env import under_launcher

    if under_launcher():
        raise UserError("doctor --nodes starts its own workers on each machine; fix: run it directly on each "
                        "machine, not under torchrun or srun")
    nodes = parse_count("--nodes", args.nodes, 2, "2")
    if not args.rdzv_endpoint:
        raise UserError(f"--nodes {nodes} needs --rdzv-endpoint HOST:PORT, where the machines meet (a free port on "
                        "one of them); fix: --rdzv-endpoint node0:29500")
    cfg = build([("command line", {"dist.nnodes": str(nodes), "dist.rdzv_endpoint": args.rdzv_endpoint,
                                   "dist.nproc": args.nproc or "1"})]).dist
    result = run_check(cfg.nnodes, cfg.rdzv_endpoint, cfg.nproc)
    if "error" in result:
        print(f"scaletrain: doctor --nodes: {result['error']}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_nodes(result)
    return EXIT_FAILURE if result["slow"] else EXIT_OK


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.cluster.doctor import diagnose, facts_dict, gather, self_test
    from scaletrain.env import launcher_env_problem, under_launcher

    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: {USAGE}")
    if args.nodes is not None:
        return _run_nodes(args)
    given = next((flag for flag, value in (("--rdzv-endpoint", args.rdzv_endpoint), ("--nproc", args.nproc))
                  if value is not None), None)
    if given:
        raise UserError(f"{given} is for the check between machines; fix: add --nodes N (scaletrain doctor "
                        f"--nodes 2 --rdzv-endpoint node0:29500), or drop {given}")
    # Before the self-test: launching sets GLOO_SOCKET_IFNAME and OMP_NUM_THREADS in this process.
    facts = gather()
    findings = diagnose(facts)
    if not args.self_test:
        result = None
    elif launcher_env_problem() is not None:  # one of the findings: no group can form
        result = {"ok": False, "error": "not run: the launcher's variables above keep a process group from forming"}
    else:
        result = self_test(under_launcher())
    # Under a launcher every rank takes part in the self-test; one report per machine is enough.
    if under_launcher() and os.environ.get("LOCAL_RANK", "0") != "0":
        return EXIT_OK
    if args.json:
        json.dump({"facts": facts_dict(facts), "findings": [vars(f) | {"line": f.line()} for f in findings],
                   "self_test": result}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(facts, findings, result)
    failed = (result is not None and not result.get("ok")) or any(f.level == "error" for f in findings)
    return EXIT_FAILURE if failed else EXIT_OK
