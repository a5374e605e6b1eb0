"""`scaletrain skypilot RECIPE|FILE.toml --nodes N --gpus KIND:G [--spot] [--bucket NAME] [--price USD]
[--out task.yaml] [--section.key=value ...]`: a SkyPilot task for the run on N cloud machines of G GPUs.

The task runs one torchrun agent per machine (SkyPilot starts `run` on every node; the first of
SKYPILOT_NODE_IPS hosts the rendezvous, SKYPILOT_TASK_ID is the job id they share) and keeps the run directory
in a bucket mounted on every node, so that a preempted spot job that SkyPilot's managed jobs (`sky jobs launch`)
restart on new machines resumes from its last checkpoint (checkpoint.resume=auto) instead of starting over.
With a price, the planner's time and cost for the config's own layout are in the file's header.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.cli.options import (
    add_config_argument,
    add_config_options,
    check_types,
    config_overrides,
    load_job,
    parse_count,
    parse_port,
)
from scaletrain.errors import UserError

HELP = ("Write a SkyPilot task (YAML) that runs this job on N cloud machines x G GPUs, its run directory in a "
        "bucket so that a preempted spot job resumes from its checkpoint, with the planner's time and cost.")
_LAYOUT = ("dist.nproc", "dist.nnodes", "dist.rdzv_endpoint", "dist.rdzv_id", "run.dir")
CHECKPOINT_EVERY = 500  # steps, where the config saves only when stopped: a preempted VM may die before its save


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False,
                       usage="scaletrain skypilot RECIPE|FILE.toml --nodes N --gpus KIND:G [--spot] "
                             "[--bucket NAME] [--price USD_PER_GPU_HOUR] [--out task.yaml] [--section.key=value ...]")
    add_config_argument(p)
    own = p.add_argument_group("skypilot")
    own.add_argument("--nodes", default="1", help="machines [default: 1]")
    own.add_argument("--gpus", default="H100:8", help="accelerator and count per machine, SkyPilot's spelling "
                     "(H100:8, A100-80GB:8, L4:1) [default: H100:8]")
    own.add_argument("--spot", action="store_true", help="spot (preemptible) machines: cheaper, and resumed "
                     "from the last checkpoint after a preemption [default: on-demand]")
    own.add_argument("--bucket", default="", help="the bucket holding the run directory [default: "
                     "scaletrain-RUN_NAME]")
    own.add_argument("--mount", default="/scaletrain-runs", help="where the bucket is mounted on every machine "
                     "[default: /scaletrain-runs]")
    own.add_argument("--port", default="29500", help="the rendezvous port on the first machine [default: 29500]")
    own.add_argument("--setup", default="", help="the shell command that installs scaletrain on a new machine "
                     "[default: pip install -e . in a scaletrain checkout, else pip install scaletrain==VERSION]")
    own.add_argument("--price", default="", help="US dollars per GPU-hour: the planner's time and cost in the "
                     "header [default: none]")
    own.add_argument("--out", default="", help="write the task here [default: standard output]")
    add_config_options(p)


def _accelerator(text: str) -> tuple[str, int]:
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_-]*):([1-9][0-9]{0,2})", text)
    if m is None:
        raise UserError(f"--gpus = {text!r}: expected KIND:COUNT (H100:8, A100-80GB:8, L4:1); fix: --gpus H100:8")
    return m.group(1), int(m.group(2))


def _setup_default() -> str:
    from scaletrain import __version__

    project = Path("pyproject.toml")
    if project.is_file() and re.search(r'^name\s*=\s*"scaletrain"', project.read_text(), re.MULTILINE):
        return "pip install -e ."
    return f"pip install scaletrain=={__version__}"


def _plan_line(config: str, kind: str, gpus: int, nodes: int, price: str, overrides: dict[str, str]) -> str:
    """The planner's time and cost for this layout (scaletrain plan, run here), or why there is none."""
    from scaletrain.cli import build_parser
    from scaletrain.cli import plan as plan_cli
    from scaletrain.plan.catalog import ACCELERATORS

    key = kind.lower()
    # SkyPilot's accelerator names: A100 is the 40 GB one (A100-80GB the other), as `sky show-gpus` lists them
    key = key if key in ACCELERATORS else {"a100": "a100-40gb"}.get(key, key)
    if key not in ACCELERATORS:
        return f"# plan: {kind} is not in the planner's catalog ({', '.join(ACCELERATORS)}): no time or cost"
    argv = ["plan", config, "--gpu", key, "--nproc", str(gpus), "--nnodes", str(nodes),
            *(["--price", price] if price else []), *(f"--{k}={v}" for k, v in overrides.items())]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        args, leftovers = build_parser().parse_known_args([*argv, "--json", str(out)])
        with contextlib.redirect_stdout(io.StringIO()):
            plan_cli.run(args, leftovers, [*argv, "--json", str(out)])
        record = json.loads(out.read_text())
    choice = record.get("choice") or {}
    chosen = next((row for row in record.get("layouts", []) if row.get("strategy") == choice.get("strategy")
                   and row.get("checkpointing") == choice.get("checkpointing")), None)
    if chosen is None:
        return f"# plan ({shlex.join(['scaletrain', *argv])}): no layout fits: {record.get('reason', '')}"
    layout = f"{chosen['strategy']}, checkpointing {chosen['checkpointing']}"
    hours, cost = chosen["run_hours"], chosen.get("cost")
    gpu_hours = hours * gpus * nodes
    money = ""
    if cost is not None:
        dollars = "under $0.01" if cost < 0.01 else f"${cost:,.{0 if cost >= 10 else 2}f}"
        money = f", {dollars} at ${float(price):g}/GPU-hour"
    return (f"# plan ({shlex.join(['scaletrain', *argv])}): {layout}, {_hours(hours)} h for the run"
            f" ({_hours(gpu_hours)} GPU-hours){money}")


def _hours(value: float) -> str:
    """Hours to the precision they have: a short run's 0.3 GPU-hours were said as 0."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}" if value >= 0.01 else "under 0.01"


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    nodes = parse_count("--nodes", args.nodes, 1, "2")
    kind, gpus = _accelerator(args.gpus)
    port = parse_port(args.port)
    if args.price:
        try:
            if not float(args.price) > 0:
                raise ValueError
        except ValueError:
            raise UserError(f"--price = {args.price!r}: expected US dollars per GPU-hour above 0; fix: --price 2.5") \
                from None
    if args.out and Path(args.out).exists():
        raise UserError(f"--out = {args.out!r}: the file exists, and is not overwritten; fix: another --out")
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    for key in _LAYOUT:
        if key in overrides:
            raise UserError(f"--{key} = {overrides[key]!r}: the task sets it (from --nodes, --gpus, --mount and "
                            "SkyPilot's variables); fix: drop it")
    cfg = load_job(args.config, overrides, nproc=gpus, nnodes=nodes, endpoint="head:29500")
    passed = dict(overrides)
    notes = []
    if cfg.checkpoint.every == 0:
        passed["checkpoint.every"] = str(CHECKPOINT_EVERY)
        notes.append(f"# checkpoint.every was 0 (save only when stopped): set to {CHECKPOINT_EVERY}, since a "
                     "preempted machine may be gone before its save completes")
    bucket = args.bucket or f"scaletrain-{cfg.run.name}".lower().replace("_", "-")
    run_dir = f"{args.mount.rstrip('/')}/{cfg.run.name}"
    train = shlex.join(["scaletrain", "train", args.config]) + ' --nproc="$SKYPILOT_NUM_GPUS_PER_NODE" ' \
        '--nnodes="$SKYPILOT_NUM_NODES" --rdzv-endpoint="$head:' + str(port) + '" --dist.rdzv_id="$SKYPILOT_TASK_ID" ' \
        + shlex.join([f"--run.dir={run_dir}", *(f"--{k}={v}" for k, v in passed.items())])
    header = ["# Written by `scaletrain skypilot`. Launch it as a managed job, which SkyPilot restarts on new",
              "# machines after a preemption or a failure (the run resumes from its last checkpoint in the bucket):",
              f"#   sky jobs launch {args.out or 'task.yaml'}",
              _plan_line(args.config, kind, gpus, nodes, args.price, overrides), *notes]
    setup = args.setup or _setup_default()
    lines = [*header,
             f"name: scaletrain-{cfg.run.name}".lower().replace("_", "-"),
             f"num_nodes: {nodes}",
             "resources:",
             f"  accelerators: {kind}:{gpus}",
             f"  use_spot: {'true' if args.spot else 'false'}",
             "  job_recovery:",
             "    max_restarts_on_errors: 3",
             "workdir: .",
             "file_mounts:",
             f"  {args.mount}:",
             f"    name: {bucket}",
             "    mode: MOUNT",
             "setup: |",
             f"  {setup}",
             "run: |",
             "  set -uo pipefail",
             "  # the first node hosts the rendezvous; every node's agent starts a worker per GPU",
             '  head=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
             f"  {train}"]
    text = "\n".join(lines) + "\n"
    if not args.out:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {nodes} machine(s) x {kind}:{gpus}{' (spot)' if args.spot else ''}, run directory "
          f"{run_dir} in bucket {bucket}; launch with: sky jobs launch {args.out}", file=sys.stderr)
    return 0
