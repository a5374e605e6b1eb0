"""`scaletrain lab descent`: gradient descent, SGD and mini-batch SGD on one least-squares line, compared in
steps and in samples to a target loss (docs/labs.md). The runs, numbers and figures are labs/descent_runs.py,
imported when the lab runs (numpy and matplotlib cost the parser nothing then).
"""

from __future__ import annotations

import argparse
from typing import Any

from scaletrain.cli.options import parse_count
from scaletrain.errors import UserError
from scaletrain.labs.flags import parse_float, refuse_leftovers
from scaletrain.labs.output import lab_dir, write_lab

HELP = ("Gradient descent vs SGD vs mini-batch SGD on a line: steps and samples to a target loss, and their "
        "paths.")
USAGE = ("scaletrain lab descent [--samples N] [--noise S] [--lr LR] [--batch B] [--target LOSS] "
         "[--steps MAX] [--repeats R] [--seed S] [--out DIR]")


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP + " Writes lab.json and three PNGs to --out.",
                       usage=USAGE, allow_abbrev=False)
    p.add_argument("--samples", metavar="N", default="256", help="data points [default: 256]")
    p.add_argument("--noise", metavar="S", default="0.5",
                   help="standard deviation of the noise around y = 2x - 1 [default: 0.5]")
    p.add_argument("--lr", metavar="LR", default="0.02", help="learning rate of every method [default: 0.02]")
    p.add_argument("--batch", metavar="B", default="16",
                   help="samples per step of mini-batch SGD [default: 16]")
    p.add_argument("--target", metavar="LOSS", default="",
                   help="loss to reach [default: L* x 1.05, 5%% above the least loss]")
    p.add_argument("--steps", metavar="MAX", default="400", help="steps each method takes [default: 400]")
    p.add_argument("--repeats", metavar="R", default="64",
                   help="shuffles each stochastic method runs, averaged for the steps to the target "
                        "[default: 64]")
    p.add_argument("--seed", metavar="S", default="0", help="seed of the data and the shuffles [default: 0]")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write [default: runs/lab-descent]")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    samples = parse_count("--samples", args.samples, 2, "256")
    batch = parse_count("--batch", args.batch, 1, "16")
    if batch > samples:
        raise UserError(f"--batch = {args.batch!r}: expected at most --samples ({samples}); fix: --batch "
                        f"{min(16, samples)}")
    steps = parse_count("--steps", args.steps, 1, "400")
    repeats = parse_count("--repeats", args.repeats, 1, "64")
    if steps * repeats > 5_000_000:  # about 10 s of numpy: a lab, not a benchmark
        raise UserError(f"--steps x --repeats = {steps} x {repeats}: expected at most 5,000,000; fix: "
                        "--steps 400 --repeats 64")
    return {"samples": samples, "noise": parse_float("--noise", args.noise, 0, low_open=True, example="0.5"),
            "lr": parse_float("--lr", args.lr, 0, 10, low_open=True, example="0.02"), "batch": batch,
            "steps": steps, "repeats": repeats, "seed": parse_count("--seed", args.seed, 0, "0")}


def _target(text: str, loss_star: float, default: float) -> float | None:
    """--target as a loss above L* (none gets below it), or None for the default."""
    if not text:
        return None
    target = parse_float("--target", text, 0, low_open=True, example=f"{default:.4f}")
    if target <= loss_star:
        raise UserError(f"--target = {text!r}: expected a loss above the least loss L* = {loss_star:.4f} of "
                        f"these data (no method gets below it); fix: --target {default:.4f}")
    return target


def _print(said: list[str], nums: dict[str, Any]) -> None:
    from scaletrain.bench.report import print_table
    from scaletrain.labs.descent_runs import shown

    for sentence in said:
        print(sentence)
    print()
    table = []
    for m in nums["methods"]:
        w, b = m["final"]
        far = ["diverged"] * 3 if m["diverged"] else \
            [f"{shown(w)}, {shown(b)}", shown(m["final_distance"]), shown(m["last_epoch_mean_distance"])]
        table.append([m["name"], str(m["batch"]), _count(m["steps_to_target"]), _count(m["samples_to_target"]),
                      *far])
    best = nums["optimum"]
    columns = ["method", "batch", "steps", "samples", "final w, b", "from optimum",
               "last epoch's mean from it"]
    print_table(f"descent: to loss {nums['target']:.4f}; optimum w* {best['w']:.3f}, b* {best['b']:.3f}",
                columns, table)


def _count(value: int | None) -> str:
    return f"{value:,}" if value is not None else "not reached"


def run(args: argparse.Namespace, leftovers: list[str]) -> int:
    refuse_leftovers(leftovers, "scaletrain lab descent [--lr 0.02] [--batch 16] ...")
    settings = _settings(args)
    from scaletrain.labs import descent_runs as dr

    problem = dr.make_problem(settings["samples"], settings["noise"], settings["seed"])
    target = _target(args.target, problem.loss_star, dr.default_target(problem))
    out = lab_dir(args.out, "descent")
    lab = dr.compare(problem, lr=settings["lr"], batch=settings["batch"], steps=settings["steps"],
                     repeats=settings["repeats"], seed=settings["seed"], target=target)
    nums = dr.numbers(lab, settings)
    said = dr.reading(lab, nums)
    figures = {"loss_vs_steps": dr.loss_figure(lab, per_sample=False),
               "loss_vs_samples": dr.loss_figure(lab, per_sample=True), "paths": dr.paths_figure(lab)}
    path = write_lab(out, "descent", reading=said, rows=dr.rows(lab, nums), numbers=nums, figures=figures)
    _print(said, nums)
    print(f"wrote {path} and {len(figures)} PNGs in {out}")
    return 0
