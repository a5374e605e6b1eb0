"""`scaletrain lab scaling-law`: fit loss = a x^(-b) + c over model (or data) sizes and predict a larger one
(docs/labs.md). The points come from finished `scaletrain train` run directories (x: parameters, samples or
tokens; y: the final eval loss), or from runs the lab trains itself (``--sizes``: the gpt-stdlib recipe at
several widths, one run directory each under --out, reused when already finished). The fit, its reading and
its figure are labs/scaling_fit.py, imported when the lab runs (numpy and scipy cost the parser nothing then).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

from scaletrain.cli.options import parse_count
from scaletrain.errors import UserError
from scaletrain.labs.flags import parse_counts, parse_float, refuse_leftovers
from scaletrain.labs.output import lab_dir, write_lab

HELP = ("Fit loss = a x^-b + c over model (or data) sizes, with intervals, and predict the loss at a larger "
        "size.")
USAGE = ("scaletrain lab scaling-law RUN_DIR... | --sizes W1,W2,... [--steps N] [--x params|tokens|samples] "
         "[--predict X] [--out DIR]")
X_KINDS = ("params", "tokens", "samples")
# --sizes: the gpt-stdlib recipe (bytes of Python's own standard library, no download), narrowed to a size
# that trains in seconds on a CPU; only model.n_embd changes between the runs.
SIZE_RECIPE = "gpt-stdlib"
SIZE_OVERRIDES = {"model.n_layer": 2, "model.n_head": 2, "data.seq_len": 64, "data.batch_size": 16,
                  "train.eval_every": 0, "train.eval_batches": 16, "train.progress": False}


# ------------------------------------------------------------------------------------------- --sizes


def size_run_dir(out: Path, width: int, steps: int) -> Path:
    """A run named by what it computes, so another --steps never reuses it."""
    return out / f"w{width}-s{steps}"


def train_width(out: Path, width: int, steps: int) -> tuple[Path, str]:
    """One gpt-stdlib run of width ``width`` through the trainer, in this process; its log goes to train.log
    in its run directory. A run directory that already holds summary.json is reused as it is."""
    from scaletrain.config import load
    from scaletrain.train.run import run as train

    path = size_run_dir(out, width, steps)
    if (path / "summary.json").is_file():
        return path, "reused"
    overrides = {**SIZE_OVERRIDES, "model.n_embd": width, "train.max_steps": steps,
                 "schedule.warmup_steps": max(steps // 10, 1), "log.every": max(steps // 10, 1),
                 "run.dir": str(path)}
    cfg = load(SIZE_RECIPE, overrides=overrides)
    path.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(path / "train.log", "a", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        train(cfg)
    return path, f"trained in {time.perf_counter() - started:.1f} s"


def train_sizes(out: Path, widths: list[int], steps: int) -> list[Any]:
    """The points of the --sizes runs (scaling_fit.Point), each said as it is done."""
    from scaletrain.labs.scaling_fit import read_point

    points = []
    for width in widths:
        path, how = train_width(out, width, steps)
        point = read_point(path, "params")
        print(f"width {width:>4}: {point.x:>11,.0f} params, eval loss {point.loss:.4f} ({how}; {path})",
              flush=True)
        points.append(point)
    return points


# ------------------------------------------------------------------------------------------- command


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP + " Writes lab.json and scaling_law.png to --out.",
                       usage=USAGE, allow_abbrev=False)
    p.add_argument("runs", metavar="RUN_DIR", nargs="*", help="finished run directories of scaletrain train")
    p.add_argument("--sizes", default="", metavar="W1,W2,...",
                   help="train the gpt-stdlib recipe (2 layers) at these widths (model.n_embd, even numbers) "
                        "first, each in its own run directory under --out, reused when finished")
    p.add_argument("--steps", metavar="N", default="200",
                   help="--sizes: optimizer steps of each run [default: 200]")
    p.add_argument("--x", default="params", metavar="{params,tokens,samples}",
                   help="what x is: the model's parameters, or the data seen [default: params]")
    p.add_argument("--predict", default="", metavar="X",
                   help="predict the loss at this x [default: 10x the largest]")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write [default: runs/lab-scaling-law]")


def _check_args(args: argparse.Namespace) -> tuple[list[int], int, float | None]:
    if args.x not in X_KINDS:
        raise UserError(f"--x = {args.x!r}: expected one of {', '.join(X_KINDS)}; fix: --x params")
    widths = parse_counts("--sizes", args.sizes, 2, "16,32,64,128") if args.sizes else []
    if len(set(widths)) < len(widths):  # one run per width: a repeat would be the same run again
        raise UserError(f"--sizes = {args.sizes!r}: a width given twice; fix: --sizes "
                        f"{','.join(map(str, sorted(set(widths))))}")
    if any(w % 2 for w in widths):
        raise UserError(f"--sizes = {args.sizes!r}: widths must be even (2 attention heads share each); "
                        f"fix: --sizes {','.join(str(w + w % 2) for w in widths)}")
    if widths and args.x != "params":
        raise UserError(f"--x = {args.x!r} with --sizes: the runs of --sizes differ in model size and see "
                        "the same data; fix: --x params, or pass run directories that differ in data")
    if not widths and not args.runs:
        raise UserError("scaling-law needs run directories or --sizes; fix: scaletrain lab scaling-law "
                        "--sizes 8,16,32,64, or scaletrain lab scaling-law RUN_DIR...")
    steps = parse_count("--steps", args.steps, 1, "200")
    predict = None
    if args.predict:
        predict = parse_float("--predict", args.predict, 0, low_open=True, example="1e7")
    return widths, steps, predict


def run(args: argparse.Namespace, leftovers: list[str]) -> int:
    refuse_leftovers(leftovers, USAGE)
    widths, steps, predict = _check_args(args)
    from scaletrain.labs import scaling_fit as sf

    points = [sf.read_point(Path(p), args.x) for p in args.runs]  # a bad RUN_DIR fails before any training
    sf.check_points(points, more=len(widths))
    if points:
        sf.check_family(points, args.x)
    out = lab_dir(args.out, "scaling-law")
    points += train_sizes(out, widths, steps)
    sf.check_points(points)
    sf.check_family(points, args.x)
    nums = sf.analyse(points, predict, args.x)
    nums["settings"] = {"sizes": widths, "steps": steps if widths else None,
                        "recipe": SIZE_RECIPE if widths else None,
                        "overrides": SIZE_OVERRIDES if widths else None}
    said = sf.reading(nums)
    path = write_lab(out, "scaling-law", reading=said, rows=sf.rows(nums), numbers=nums,
                     figures={"scaling_law": sf.figure(nums)})
    _print(said, nums)
    print(f"wrote {path} and scaling_law.png in {out}")
    return 0


def _print(said: list[str], nums: dict[str, Any]) -> None:
    from scaletrain.bench.report import print_table
    from scaletrain.labs.scaling_fit import law_of

    print()
    for sentence in said:
        print(sentence)
    print()
    law = law_of(nums)
    table = []
    for p in sorted(nums["points"], key=lambda p: p["x"]):
        loss = f"{p['loss']:.4f}" + " (train)" * (p["loss_kind"] == "train")
        table.append([Path(p["run"]).name, f"{p['x']:,.0f}", loss, f"{float(law(p['x'])):.4f}"])
    print_table("scaling law: the runs and the fit", ["run", nums["x_kind"], "loss", "fit"], table)
