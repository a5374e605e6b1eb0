"""`scaletrain lab batch-size`: the same epochs at growing global batches, with and without Goyal et al.'s
(2017) linear scaling rule and gradual warmup; how far the rule keeps the final metric, and where it breaks.

The runs themselves (planned, trained through the trainer, reused, failed) are in labs/batch_runs.py; this
module is the command, the reading and the figures (docs/labs.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.cli.options import add_config_argument, add_config_options, check_types, config_overrides
from scaletrain.errors import UserError
from scaletrain.labs.flags import parse_counts, parse_float

if TYPE_CHECKING:
    from scaletrain.labs.batch_runs import RunSpec, Setting

HELP = ("Train a recipe at growing global batches for the same epochs, with the linear scaling rule and "
        "warmup and without: where the rule keeps the final metric, and where it breaks.")
USAGE = ("scaletrain lab batch-size RECIPE|FILE.toml --batches 32,64,128,... [--scale-lr linear|sqrt|none] "
         "[--warmup EPOCHS] [--no-compare] [--nproc N] [--tolerance T] [--out DIR] [--section.key=value ...]")
LAB = "batch-size"
_GOYAL = ("Goyal et al. (2017) kept ResNet-50's ImageNet accuracy with the linear rule and 5 epochs of "
          "warmup up to a batch of 8k: 8,192 of 1.28M images, 0.6% of the data per step.")


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.labs.batch_runs import RULES

    about = HELP + " Training options (--section.key=value) apply to every run; --nproc N: each on N ranks."
    p = sub.add_parser(name, help=HELP, description=about, allow_abbrev=False, usage=USAGE)
    add_config_argument(p)
    own = p.add_argument_group("lab")
    own.add_argument("--batches", required=True, metavar="B1,B2,...",
                     help="global batches (samples per optimizer step), comma-separated, e.g. 32,64,128,256; "
                     "the smallest trains at the config's own lr")
    own.add_argument("--scale-lr", default="linear", choices=RULES,
                     help="how the peak lr follows the batch from the smallest one's: x k (linear, Goyal et "
                     "al.), x sqrt(k), or not at all [default: linear]")
    own.add_argument("--warmup", default=None, metavar="EPOCHS",
                     help="epochs of gradual warmup from the smallest batch's lr up to each batch's (Goyal "
                     "et al.: 5 of 90) [default: a tenth of train.epochs]")
    own.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                     help="also train every batch without a rule (lr fixed, no warmup), to see what the rule "
                     "buys [default: --compare]")
    own.add_argument("--tolerance", default="1", metavar="T",
                     help="how close to the smallest batch counts as kept: points of accuracy, or percent of "
                     "eval loss for a model without accuracy [default: 1]")
    own.add_argument("--out", default="", metavar="DIR",
                     help="the lab's directory: lab.json, the figures, one run directory per run; finished "
                     "runs there are reused [default: runs/lab-batch-size]")
    add_config_options(p)


def parse_warmup(text: str | None, epochs: int) -> float:
    """--warmup in epochs, in [0, epochs]; default a tenth of the run's epochs."""
    if text is None:
        return epochs / 10
    return parse_float("--warmup", text, 0, epochs, example=f"{epochs / 10:g}")


def parse_batches(text: str) -> list[int]:
    """'64,32,128' -> [32, 64, 128]: at least two distinct positive integers, sorted."""
    batches = sorted(set(parse_counts("--batches", text, 1, "32,64,128,256")))
    if len(batches) < 2:
        raise UserError(f"--batches = {text!r}: expected at least two global batches to compare; fix: "
                        f"--batches {batches[0]},{batches[0] * 8}")
    return batches


def run(args: argparse.Namespace, leftovers: list[str]) -> int:
    from scaletrain.config import load
    from scaletrain.labs.batch_runs import plan_runs
    from scaletrain.labs.output import lab_dir, write_lab

    batches = parse_batches(args.batches)
    tolerance = parse_float("--tolerance", args.tolerance, 0, low_open=True, example="1")
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    epochs = load(args.config, cli_overrides=overrides).train.epochs  # a bad recipe or key fails here, first
    settings = _settings(args, epochs)
    # Every run planned and checked before the lab's directory is made (lab_dir's default: runs/lab-NAME).
    base, train_size, specs = plan_runs(args.config, overrides, batches, settings,
                                        Path(args.out or f"runs/lab-{LAB}"))
    out = lab_dir(args.out or None, LAB)
    print(f"batch-size lab: {args.config}, {_epochs(epochs)} of {train_size:,} samples at batches "
          f"{', '.join(map(str, batches))} ({', '.join(s.name for s in settings)}); "
          f"{len({s.dir for s in specs})} runs in {out}", flush=True)
    done = _train_all(specs, args.config, base.dist.nproc)
    runs = [_record(spec, done[spec.dir]) for spec in specs]
    numbers = _numbers(args.config, train_size, base.dist.nproc, epochs, tolerance, settings, runs)
    reading = _reading(numbers)
    write_lab(out, LAB, reading=reading, rows=_rows(numbers), numbers=numbers,
              figures={"metric_vs_batch": _metric_figure(numbers), "curves": _curves_figure(numbers, out)})
    _print(numbers, reading, out)
    return 0


def _settings(args: argparse.Namespace, epochs: int) -> list[Setting]:
    """The chosen rule with its warmup, and (with --compare) no rule at all."""
    from scaletrain.labs.batch_runs import Setting

    warmup = parse_warmup(args.warmup, epochs)
    if args.scale_lr == "none" and warmup:
        if args.warmup is not None:
            print(f"scaletrain: warning: --warmup {args.warmup} ignored with --scale-lr none: warmup ramps "
                  "from the smallest batch's lr to each batch's, and without a rule they are the same",
                  file=sys.stderr)
        warmup = 0.0
    settings = [Setting(args.scale_lr, warmup)]
    if args.compare and settings[0] != Setting("none", 0.0):
        settings.append(Setting("none", 0.0))
    return settings


def _train_all(specs: Sequence[RunSpec], recipe: str, nproc: int) -> dict[Path, dict[str, Any]]:
    """Each run once (settings that ask for the same computation share it), one line each as it ends."""
    from scaletrain.labs.batch_runs import train

    count = len({s.dir for s in specs})
    done: dict[Path, dict[str, Any]] = {}
    for spec in specs:
        if spec.dir not in done:
            print(f"[{len(done) + 1}/{count}] batch {spec.batch}, {spec.setting.name}: lr {spec.lr:.4g}, "
                  f"warmup {spec.warmup_steps} steps, {spec.steps} steps ... ", end="", flush=True)
            done[spec.dir] = train(spec, recipe, nproc)
            print(_outcome(done[spec.dir]), flush=True)
    return done


def _outcome(result: dict[str, Any]) -> str:
    if "failed" in result:
        return f"failed: {result['failed']}"
    summary = result["summary"]
    found = (summary["eval"] or {}).items()
    what = ", ".join(f"{k} {_shown(k, v)}" for k, v in found if k in ("accuracy", "loss")) or "no eval"
    took = "reused" if result["reused"] else f"{summary['wall_s']:.1f} s"
    return f"{what} ({took})"


def _epochs(n: int) -> str:
    return f"{n} epoch{'s' if n != 1 else ''}"


def _shown(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" if metric == "accuracy" else f"{value:.4f}"


def _record(spec: RunSpec, result: dict[str, Any]) -> dict[str, Any]:
    """One row of numbers: the run's settings and, unless it failed, what its summary.json measured."""
    row: dict[str, Any] = {"batch": spec.batch, "setting": spec.setting.name, "rule": spec.setting.rule,
                           "warmup_epochs": spec.setting.warmup, "lr": spec.lr,
                           "warmup_steps": spec.warmup_steps, "micro_batch": spec.micro, "steps": spec.steps,
                           "dir": spec.dir.name, "reused": bool(result.get("reused")),
                           "failed": result.get("failed"), "eval": {}}
    if "summary" in result:
        s = result["summary"]
        row.update({"steps": s["steps"], "samples": s["samples"], "epochs": s["epochs"],
                    "wall_s": s["wall_s"], "accum_steps": s["accum_steps"], "train_loss": s["train_loss"],
                    "eval": s["eval"] or {}})
    return row


def _metric(runs: Sequence[dict[str, Any]]) -> str:
    """accuracy where the model has it, else eval loss."""
    return "accuracy" if any("accuracy" in r["eval"] for r in runs) else "loss"


def _within(value: float, ref: float, metric: str, tolerance: float) -> bool:
    if metric == "accuracy":
        return value >= ref - tolerance / 100
    return value <= ref * (1 + tolerance / 100)


def _holds(runs: Sequence[dict[str, Any]], metric: str, tolerance: float) -> dict[str, Any]:
    """One setting's runs, by batch: the largest batch up to which every run stays within the tolerance of the
    smallest batch's (a failed run breaks it), and the first that does not."""
    values = [r["eval"].get(metric) for r in runs]
    ref = values[0]
    if ref is None:
        return {"reference": None, "holds_up_to": None, "breaks_at": None}
    holds, breaks = runs[0]["batch"], None
    for run, value in zip(runs[1:], values[1:]):
        if value is None or not _within(value, ref, metric, tolerance):
            breaks = run["batch"]
            break
        holds = run["batch"]
    return {"reference": ref, "holds_up_to": holds, "breaks_at": breaks}


def _numbers(recipe: str, train_size: int, nproc: int, epochs: int, tolerance: float,
             settings: Sequence[Setting], runs: list[dict[str, Any]]) -> dict[str, Any]:
    metric = _metric(runs)
    per_setting = []
    for setting in settings:
        mine = [r for r in runs if r["setting"] == setting.name]
        per_setting.append({"name": setting.name, "rule": setting.rule, "warmup_epochs": setting.warmup,
                            **_holds(mine, metric, tolerance)})
    for run in runs:
        run["metric"] = run["eval"].get(metric)
    return {"recipe": recipe, "train_size": train_size, "nproc": nproc, "epochs": epochs, "metric": metric,
            "tolerance": tolerance, "tolerance_unit": "points" if metric == "accuracy" else "percent",
            "batches": sorted({r["batch"] for r in runs}), "settings": per_setting, "runs": runs}


def _find(numbers: dict[str, Any], setting: str, batch: int | None) -> dict[str, Any] | None:
    return next((r for r in numbers["runs"] if r["setting"] == setting and r["batch"] == batch), None)


def _reading(numbers: dict[str, Any]) -> list[str]:
    """Sentences on what the numbers say: how far the rule keeps the metric and where it breaks, what the same
    batches reach without it, and how this compares with Goyal et al."""
    lines = []
    for s in numbers["settings"]:
        if s["reference"] is None:
            lines.append(f"{s['name']}: the run at batch {numbers['batches'][0]} failed, so there is nothing "
                         "to compare with.")
        elif s["rule"] == "none" and (told := _without_rule(numbers, s)):
            lines.append(told)
        else:
            lines += _kept(numbers, s)
    lines += _goyal(numbers)
    failed = {r["dir"] for r in numbers["runs"] if r["failed"]}
    if failed:
        lines.append(f"{len(failed)} run(s) failed (their rows say why; train.log in each run directory has "
                     "the whole output); the others are read as usual.")
    return lines


def _goyal(numbers: dict[str, Any]) -> list[str]:
    """Goyal et al.'s limit beside this lab's, as a share of the training set per step."""
    rules = [s for s in numbers["settings"] if s["rule"] != "none" and s["reference"] is not None]
    if not rules:
        return []
    held, broke = rules[0]["holds_up_to"], rules[0]["breaks_at"]
    size = numbers["train_size"]
    if held != numbers["batches"][0]:
        here = f"Here batch {held} is {100 * held / size:.0f}% of the {size:,} training samples"
    elif broke is not None:
        here = f"Here batch {broke} is already {100 * broke / size:.0f}% of the {size:,} training samples"
    else:
        return []
    told = (f"{_GOYAL} {here}: the rule gives out when too few steps are left to follow the small batch's "
            "path, not at a batch size of its own.")
    return [told]


def _unit(numbers: dict[str, Any]) -> str:
    tol = numbers["tolerance"]
    return f"{tol:g} point{'s' if tol != 1 else ''}" if numbers["metric"] == "accuracy" else f"{tol:g}%"


def _kept(numbers: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """How far one setting keeps the smallest batch's metric, and the batch where it stops."""
    metric, batch0 = numbers["metric"], numbers["batches"][0]
    first, top = _find(numbers, s["name"], batch0), _find(numbers, s["name"], s["holds_up_to"])
    assert first is not None and top is not None
    ref = f"batch {batch0}'s {_shown(metric, s['reference'])}"
    lines = []
    if s["holds_up_to"] != batch0:
        lines.append(f"{s['name']}: eval {metric} stays within {_unit(numbers)} of {ref} up to batch "
                     f"{s['holds_up_to']} ({_shown(metric, top['metric'])} in {top['steps']:,} steps instead "
                     f"of {first['steps']:,}).")
    if s["breaks_at"] is not None:
        bad = _find(numbers, s["name"], s["breaks_at"])
        assert bad is not None
        where = f"It breaks at batch {bad['batch']}" if s["holds_up_to"] != batch0 else \
            f"{s['name']}: already at batch {bad['batch']}"
        if bad["failed"]:
            lines.append(f"{where}: the run failed at lr {bad['lr']:.4g}: {bad['failed']}.")
        else:
            share = 100 * bad["batch"] / numbers["train_size"]
            off = "" if s["holds_up_to"] != batch0 else f" it is more than {_unit(numbers)} off"
            lines.append(f"{where}{off}: {_shown(metric, bad['metric'])} (vs {ref}) at lr {bad['lr']:.4g} in "
                         f"{bad['steps']:,} steps, each step {share:.0f}% of the training set.")
    return lines


def _without_rule(numbers: dict[str, Any], plain: dict[str, Any]) -> str:
    """At the largest batch a rule keeps, what the same batch reaches without one ('' where none does)."""
    rules = [s for s in numbers["settings"] if s["rule"] != "none" and s["holds_up_to"]]
    if not rules or rules[0]["holds_up_to"] == numbers["batches"][0]:
        return ""
    metric, batch = numbers["metric"], rules[0]["holds_up_to"]
    ruled, unruled = _find(numbers, rules[0]["name"], batch), _find(numbers, plain["name"], batch)
    if ruled is None or unruled is None or unruled["metric"] is None:
        return ""
    k = batch / numbers["batches"][0]
    told = (f"Without a rule (lr {unruled['lr']:.4g} at every batch, no warmup), batch {batch} reaches "
            f"{_shown(metric, unruled['metric'])} (vs {_shown(metric, ruled['metric'])} with it): the same "
            f"epochs are {k:g}x fewer steps, at the same lr they move the weights about {k:g}x less, and it "
            "under-trains")
    if plain["holds_up_to"] != numbers["batches"][0]:
        told += f"; it stays within {_unit(numbers)} only up to batch {plain['holds_up_to']}"
    return told + "."


def _rows(numbers: dict[str, Any]) -> list[tuple[str, str]]:
    metric = numbers["metric"]
    rows = []
    for r in numbers["runs"]:
        head = f"batch {r['batch']}, {r['setting']}"
        plan = f"lr {r['lr']:.4g}, warmup {r['warmup_steps']} steps, {r['steps']:,} steps"
        if r["failed"]:
            rows.append((head, f"{plan}: failed: {r['failed']}"))
            continue
        took = f"{r['wall_s']:.1f} s" + (" (reused)" if r["reused"] else "")
        result = f"{metric} {_shown(metric, r['metric'])}"
        rows.append((head, f"{plan}, {r['samples']:,} samples, {took}: {result}"))
    for s in numbers["settings"]:
        kept = "-" if s["holds_up_to"] is None else f"batch {s['holds_up_to']}"
        rows.append((f"{s['name']}: kept up to", kept))
    return rows


def _print(numbers: dict[str, Any], reading: Sequence[str], out: Path) -> None:
    from scaletrain.bench.report import print_table

    metric = numbers["metric"]
    table = []
    for r in numbers["runs"]:
        plan = [str(r["batch"]), r["setting"], f"{r['lr']:.4g}", str(r["warmup_steps"]), f"{r['steps']:,}"]
        if r["failed"]:
            table.append([*plan, "-", "-", f"failed: {r['failed']}"])
        else:
            took = "reused" if r["reused"] else f"{r['wall_s']:.1f}"
            table.append([*plan, f"{r['samples']:,}", took, _shown(metric, r["metric"])])
    caption = "\n".join(reading) + f"\nwrote {out / 'lab.json'}, metric_vs_batch.png, curves.png"
    print_table(f"batch-size lab: {numbers['recipe']}, {_epochs(numbers['epochs'])}",
                ["batch", "setting", "lr", "warmup steps", "steps", "samples", "wall s", f"eval {metric}"],
                table, caption=caption)


def _metric_figure(numbers: dict[str, Any]) -> Any:
    """Final metric vs global batch, log2 x axis, one line per setting: the shape of Goyal et al.'s figure."""
    from matplotlib.figure import Figure

    metric, scale = numbers["metric"], 100 if numbers["metric"] == "accuracy" else 1
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for s in numbers["settings"]:
        done = [r for r in numbers["runs"] if r["setting"] == s["name"] and r["metric"] is not None]
        ax.plot([r["batch"] for r in done], [scale * r["metric"] for r in done], marker="o", label=s["name"])
        if s["reference"] is not None and s["rule"] != "none":
            tol = numbers["tolerance"]
            edge = scale * s["reference"] - tol if metric == "accuracy" else s["reference"] * (1 + tol / 100)
            ax.axhline(edge, linestyle="--", color="gray", linewidth=1, label=f"{s['name']}: tolerance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(numbers["batches"], [str(b) for b in numbers["batches"]])
    ax.minorticks_off()
    ax.set_title(f"{numbers['recipe']}: final eval {metric} after {_epochs(numbers['epochs'])}")
    ax.set_xlabel("global batch (samples per step)")
    ax.set_ylabel(f"eval {metric}" + (" (%)" if metric == "accuracy" else ""))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return fig


def _curves_figure(numbers: dict[str, Any], out: Path) -> Any:
    """Training loss and the eval metric of every run against epochs: one colour per batch, one line style per
    setting."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    from scaletrain.labs.batch_runs import curves

    metric = numbers["metric"]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    loss_ax, eval_ax = fig.subplots(1, 2)
    colours = colormaps["viridis"]
    batches = numbers["batches"]
    styles = {s["name"]: style for s, style in zip(numbers["settings"], ("-", "--", ":"))}
    drawn = set()
    for r in numbers["runs"]:
        if r["failed"] or r["dir"] in drawn:
            continue
        drawn.add(r["dir"])
        found = curves(out / r["dir"])
        colour = colours(batches.index(r["batch"]) / max(1, len(batches) - 1))
        label = f"{r['batch']}, {r['setting']}"
        for ax, key in ((loss_ax, "train"), (eval_ax, f"eval_{metric}")):
            if found[key]:
                xs, ys = zip(*found[key])
                if key == "eval_accuracy":
                    ys = tuple(100 * y for y in ys)
                ax.plot(xs, ys, linestyle=styles[r["setting"]], color=colour, label=label)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss")
    eval_ax.set_ylabel(f"eval {metric}" + (" (%)" if metric == "accuracy" else ""))
    for ax in (loss_ax, eval_ax):
        ax.set_xlabel("epochs")
        ax.grid(True, alpha=0.3)
    if eval_ax.get_legend_handles_labels()[0]:  # none where every run failed or left no metrics
        eval_ax.legend(fontsize=7)
    fig.suptitle(f"{numbers['recipe']}: every run against epochs (colour: batch; line: setting)")
    return fig
