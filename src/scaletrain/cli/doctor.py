"""`scaletrain doctor [--self-test/--no-self-test] [--json]`: this machine's setup for a bug report, the
classic mistakes flagged one line each with the fix, and a 2-rank all-reduce self-test."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from scaletrain.errors import EXIT_FAILURE, EXIT_OK, UserError

HELP = "Report versions, devices, launcher/Slurm/NCCL settings and network; flag classic mistakes; self-test."


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP + " Exit code 1 when the self-test fails or a finding "
                       "is an error (a setup that cannot work). Under torchrun it reports once per machine and "
                       "self-tests the launcher's whole world.",
                       usage="scaletrain doctor [--self-test/--no-self-test] [--json]", allow_abbrev=False)
    p.add_argument("--self-test", action=argparse.BooleanOptionalAction, default=True,
                   help="run a 2-rank all-reduce (Gloo on CPU, NCCL with 2+ GPUs): result checked, bandwidth "
                   "measured [default: on]")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


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


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.cluster.doctor import diagnose, facts_dict, gather, self_test
    from scaletrain.env import under_launcher

    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: scaletrain doctor [--self-test/"
                        "--no-self-test] [--json]")
    # Before the self-test: launching sets GLOO_SOCKET_IFNAME and OMP_NUM_THREADS in this process.
    facts = gather()
    findings = diagnose(facts)
    result = self_test(under_launcher()) if args.self_test else None
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
