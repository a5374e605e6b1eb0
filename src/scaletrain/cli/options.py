"""Command-line options generated from the config tree: one --section.key per field, help from its docstring."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from scaletrain.config import (
    ALIASES,
    CLI,
    all_keys,
    allowed,
    coerce,
    recipe_names,
    sections,
    spec,
    unknown_key,
)
from scaletrain.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit code 2 through main(), never usage text + traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}; fix: run '{self.prog} --help'")


def _metavar(tp: object) -> str:
    if get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in get_args(tp)) + "}"
    return {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}.get(tp, "VALUE")  # type: ignore[call-overload]


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """The RECIPE|FILE.toml positional of the subcommands that load a training config."""
    parser.add_argument("config", metavar="RECIPE|FILE.toml", help=f"a built-in recipe ({', '.join(recipe_names())}) "
                        "or a TOML file with [section] tables")


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """--section.key VALUE for every config field, grouped by section; --nproc etc. as short aliases. The help
    of a number or a string field ends with its declared range (a Literal's choices are in its metavar)."""
    keys = all_keys()
    for sec, cls in sections().items():
        group = parser.add_argument_group(f"[{sec}]")
        for f in fields(cls):
            key = f"{sec}.{f.name}"
            tp, doc = keys[key]
            default = f.default if f.default is not MISSING else None
            names = [f"--{key}"] + [f"--{alias}" for alias, target in ALIASES.items() if target == key]
            extra = {"nargs": "?", "const": "true"} if tp is bool else {}
            allows = f"{allowed(key)}; " if spec(key) is not None else ""
            group.add_argument(*names, dest=key, metavar=_metavar(tp), default=argparse.SUPPRESS,
                               help=f"{doc} [{allows}default: {default!r}]", **extra)


def config_overrides(namespace: argparse.Namespace, leftovers: list[str]) -> dict[str, str]:
    """The --section.key values given on the command line, as strings; an unknown --key is a ConfigError."""
    for i, token in enumerate(leftovers):
        if token == "--":
            raise UserError("unexpected argument '--' (verify-resume passes what follows it to a script's own "
                            "arguments); fix: pass options as --section.key=value")
        if token.startswith("--"):
            key, eq, value = token[2:].partition("=")
            if not eq and i + 1 < len(leftovers) and not leftovers[i + 1].startswith("--"):
                value = leftovers[i + 1]  # --key value
            raise unknown_key(key, value, CLI)
        raise UserError(f"unexpected argument {token!r}; fix: pass options as --section.key=value")
    known = all_keys()
    return {k: v for k, v in vars(namespace).items() if k in known}


def check_types(overrides: dict[str, str]) -> None:
    """Type-check command-line values early (load() does it again with their final origin)."""
    keys = all_keys()
    for key, value in overrides.items():
        coerce(key, value, keys[key][0], CLI, from_text=True)


def parse_count(flag: str, text: str, low: int, example: str = "") -> int:
    """A subcommand's own integer option: ``text`` as an integer >= ``low``, else one line naming the flag."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise UserError(f"{flag} = {text!r}: expected an integer >= {low}; fix: {flag} {example or max(low, 10)}")
    return value


def parse_overrides(argv: list[str]) -> dict[str, str]:
    """A script's own ``--section.key=value`` arguments (scaletrain.session(argv=sys.argv[1:])) as config
    overrides, checked as the CLI checks them; anything else is one clear error."""
    parser = Parser(prog="scaletrain.session", add_help=False, allow_abbrev=False)
    add_config_options(parser)
    args, leftovers = parser.parse_known_args(argv)
    overrides = config_overrides(args, leftovers)
    check_types(overrides)
    return overrides


def command_line_options(argv: list[str]) -> list[str]:
    """scaletrain's own options on a script's command line, for fit() and session() called without ``argv``:
    each ``--section.key[=value]`` of a config section (and its value when it is the next argument), before a
    lone ``--``; the script's own arguments are left to it. `scaletrain launch --nproc 2 my.py
    --parallel.strategy=fsdp`, and the --run.dir and --chaos.* that verify-resume and a Slurm requeue give a
    script, reached a fit() whose author never passed argv only through it: without, they were dropped unsaid."""
    ours = set(sections())
    taken: list[str] = []
    i = 0
    while i < len(argv) and argv[i] != "--":
        token = argv[i]
        key, eq, _ = token[2:].partition("=")
        if token.startswith("--") and key.partition(".")[0] in ours and "." in key:
            taken.append(token)
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                taken.append(argv[i + 1])  # --key value
                i += 1
        i += 1
    return taken


def parse_port(text: str, flag: str = "--port") -> int:
    """A TCP port in [1, 65535], else one line naming the flag."""
    port = parse_count(flag, text, 1, "29500")
    if port > 65535:
        raise UserError(f"{flag} = {text!r}: expected a TCP port in [1, 65535]; fix: {flag} 29500")
    return port


def load_job(config: str, overrides: dict[str, str], *, nproc: int, nnodes: int, endpoint: str) -> Any:
    """The config of a job this command lays out itself (nproc workers on each of nnodes machines meeting at
    ``endpoint``), its degrees checked against that world before anything is written or started."""
    from scaletrain.config import load
    from scaletrain.layout import check_layout
    from scaletrain.train.batching import check_global_batch

    cfg = load(config, cli_overrides={**overrides, "dist.nproc": str(nproc), "dist.nnodes": str(nnodes),
                                      "dist.rdzv_endpoint": endpoint})
    check_layout(cfg.parallel, cfg.memory, nproc * nnodes, nnodes, cfg.model, cfg.data.batch_size,
                 cfg.data.seq_len)
    check_global_batch(cfg, nproc * nnodes)
    return cfg


def out_dir(path: Path, flag: str, example: str) -> Path:
    """An output directory (``--out`` of a lab, a report, a rehearsal; an exported file's folder), created with
    its parents; one that cannot be is one line naming it, not a traceback after the work."""
    from scaletrain.config import dir_problem

    if problem := dir_problem(path):
        raise UserError(f"{flag} = {str(path)!r}: expected a directory this process can create and write "
                        f"({problem}); fix: {flag} {example}")
    path.mkdir(parents=True, exist_ok=True)
    return path
