"""`scaletrain report RUN_DIR [RUN_B ...] [--out DIR]`: plots, a self-contained report.html and a table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scaletrain.cli.options import out_dir
from scaletrain.errors import UserError

HELP = "Plot one run (or overlay several) into a self-contained report.html and PNGs, and print a summary table."


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help=HELP, description=HELP + " Reads metrics.jsonl and summary.json "
                       "(docs/metrics.md); writes report.html, one PNG per chart and report.json.",
                       usage="scaletrain report RUN_DIR [RUN_B ...] | LAB_DIR [--out DIR]",
                       allow_abbrev=False)
    p.add_argument("runs", metavar="RUN_DIR", nargs="*", help="run directories (--run.dir of scaletrain train); "
                   "two or more are overlaid in the same plots; or one lab directory (--out of scaletrain "
                   "lab)")
    p.add_argument("--out", metavar="DIR", default=None, help="where to write [default: RUN_DIR/report; "
                   "RUN_A/report-vs-RUN_B when comparing]")


def _print_table(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="scaletrain report", title_justify="left")
    table.add_column("", style="bold")
    for run in report.runs:
        table.add_column(run.name, overflow="fold")
    for name, values in report.rows:  # plain text: a failed run's error quotes gloo's '[/__w/...cc:129]'
        table.add_row(Text(name), *map(Text, values))
    console = Console(highlight=False, soft_wrap=False)
    console.print(table)
    for chart in report.charts:
        if chart.note:
            console.print(f"note: {chart.name}: {chart.note}", markup=False)
    drawn = sum(1 for c in report.charts if c.figure is not None)
    console.print(f"wrote {report.out / 'report.html'} and {drawn} PNG{'s' * (drawn != 1)} in {report.out}",
                  markup=False)


def _report_lab(paths: list[str], out: str | None) -> int:
    """A lab directory (one holding lab.json, from `scaletrain lab`): its reading, rows and figures."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from scaletrain.observe.report.lab import write_lab_report

    if len(paths) > 1:
        raise UserError(f"{', '.join(paths)}: a lab directory is reported alone, not beside runs or other "
                        f"labs; fix: scaletrain report {paths[0]}")
    report = write_lab_report(Path(paths[0]), Path(out) if out else None)
    table = Table(title=f"scaletrain report: lab {report.name}", title_justify="left")
    table.add_column("", style="bold")
    table.add_column(Path(paths[0]).name, overflow="fold")
    for name, value in report.rows:
        table.add_row(Text(name), Text(value))
    console = Console(highlight=False, soft_wrap=False)
    console.print(table)
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    console.print(f"wrote {report.out / 'report.html'}", markup=False)
    return 0


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: scaletrain report RUN_DIR [RUN_B ...] "
                        "[--out DIR]")
    if not args.runs:
        raise UserError("report needs at least one RUN_DIR; fix: scaletrain report runs/digits (or two run "
                        "directories to compare them)")
    # Imported here: matplotlib costs a second at import, and only this command needs it.
    from scaletrain.observe.report import write_report
    from scaletrain.observe.report.lab import is_lab

    if args.out and not Path(args.out).exists():  # made or refused before anything is read or drawn (a file
        out_dir(Path(args.out), "--out", "reports/mine")  # there: write_report's own line)
    if any(is_lab(Path(p)) for p in args.runs):
        return _report_lab(args.runs, args.out)
    report = write_report([Path(p) for p in args.runs], Path(args.out) if args.out else None)
    _print_table(report)
    return 0
