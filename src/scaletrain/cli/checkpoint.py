"""`scaletrain checkpoint inspect PATH` and `scaletrain checkpoint export PATH OUT.safetensors`."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from scaletrain.config import dir_problem
from scaletrain.errors import CheckpointError, UserError

HELP = "Inspect a checkpoint (step, world size, config digest, sizes, checksums) or export its weights."


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.cli.options import Parser

    p = sub.add_parser(name, help=HELP, description=HELP, allow_abbrev=False)
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=Parser)
    i = actions.add_parser("inspect", help="show a checkpoint (or every checkpoint of a run) and verify checksums",
                           allow_abbrev=False)
    i.add_argument("path", metavar="PATH", help="a step-NNNNNNNN directory, a checkpoints directory or a run directory")
    i.add_argument("--no-hashes", action="store_true", help="check sizes only (fast on large checkpoints)")
    i.add_argument("--json", action="store_true", help="print JSON instead of tables")
    e = actions.add_parser("export", help="write the consolidated weights as one safetensors file",
                           allow_abbrev=False)
    e.add_argument("path", metavar="PATH", help="a step-NNNNNNNN directory (or a run directory: its latest)")
    e.add_argument("out", metavar="OUT.safetensors", help="the file to write (never overwritten)")
    e.add_argument("--best", action="store_true", help="the run's best checkpoint (--checkpoint.best: the lowest "
                   "held-out loss), not its latest")


def _checkpoints(path: Path) -> list[Path]:
    from scaletrain.checkpoint import commit

    if not path.exists():
        raise UserError(f"{path}: no such file or directory; fix: point at a run directory or a step-NNNNNNNN "
                        "directory")
    if (path / commit.MANIFEST).is_file() or commit.step_of(path) is not None:
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [p for _, p in commit.committed(root)]
    if not found:
        raise UserError(f"{path}: holds no checkpoint (no step-NNNNNNNN directories); fix: point at a run "
                        "directory that was trained with --checkpoint.every")
    return found


def _newest_sound(path: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to export and its manifest: one named by its step directory, or else the newest of a run
    whose files match their manifest, as a resume takes it (a damaged newer one said on stderr and passed over,
    not moved: export only reads). None sound: the newest one's error."""
    from scaletrain.checkpoint import commit

    found = _checkpoints(path)
    if len(found) > 1 and (sound := commit.latest_valid(found[-1].parent, _warn, move=False)) is not None:
        return sound
    return found[-1], commit.verify(found[-1])


def _best(path: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a run's best.json names (checkpoint.best), and its manifest."""
    from scaletrain.checkpoint import commit

    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    best = commit.best_path(root)
    if best is None:
        raise UserError(f"{path}: names no best checkpoint ({root / commit.BEST} is missing); fix: point at the run "
                        "directory of a run trained with --checkpoint.best, or export its latest without --best")
    if not best.is_dir():
        raise UserError(f"{root / commit.BEST}: names {best.name}, which is not there (moved aside as damaged?); fix: "
                        f"export another checkpoint of {root} by its step-NNNNNNNN directory")
    return best, commit.verify(best)


def _warn(line: str) -> None:
    print(f"scaletrain: warning: {line}", file=sys.stderr)


def _describe(path: Path, hashes: bool) -> dict[str, Any]:
    """What inspect says of one checkpoint. status: verified (or "sizes ok" without hashes), BAD (its files do
    not match the manifest) or damaged (they do, but do not load: train/checkpointing.py check_contents);
    problem: why, for the last two."""
    from scaletrain.checkpoint import commit
    from scaletrain.train.checkpointing import Resume, check_contents

    info: dict[str, Any] = {"path": str(path), "step": commit.step_of(path)}
    try:
        manifest = commit.verify(path, hashes=hashes)
    except CheckpointError as err:
        info.update(status="BAD", problem=str(err))
        try:
            manifest = commit.read_manifest(path)
        except CheckpointError:
            return info
    else:
        try:
            check_contents(Resume(path, manifest))
            info["status"] = "verified" if hashes else "sizes ok"
        except CheckpointError as err:
            info.update(status="damaged", problem=str(err))
    meta = manifest.get("meta", {})
    info.update(step=manifest["step"], created=manifest.get("created"), files=manifest["files"],
                bytes=sum(_on_disk(path / name) for name in manifest["files"]),  # a truncated file's own size
                **{k: meta.get(k) for k in ("format", "epoch", "world_size", "global_batch", "config_digest",
                                            "torch", "scaletrain")})
    return info


def _on_disk(file: Path) -> int:
    """A file's size as it is (0 when it is missing), not as the manifest recorded it."""
    try:
        return file.stat().st_size
    except OSError:
        return 0


def _table(title: str, columns: dict[str, str]) -> Any:
    """A table that fits 80 columns: no outer edge, and a cell too wide wraps instead of being cut."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name, justify in columns.items():
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    return table


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from scaletrain.checkpoint import commit
    from scaletrain.observe.memory import fmt_bytes

    found = _checkpoints(Path(args.path))
    infos = [_describe(p, not args.no_hashes) for p in found]
    best = commit.best_path(found[0].parent)
    for path, info in zip(found, infos):
        info["best"] = path == best
    if args.json:
        print(json.dumps(infos, indent=1))
        return 0 if all("problem" not in i for i in infos) else 1
    console = Console(highlight=False)
    table = _table(f"checkpoints in {args.path}", {"step": "right", "epoch": "right", "world": "right",
                                                   "batch": "right", "config": "left", "size": "right",
                                                   "created": "left", "status": "left"})
    for info in infos:
        created = info.get("created")
        when = datetime.datetime.fromtimestamp(created).strftime("%m-%d %H:%M") if created else "?"
        table.add_row(str(info.get("step")), str(info.get("epoch", "?")), str(info.get("world_size", "?")),
                      str(info.get("global_batch", "?")), str(info.get("config_digest", "?"))[:8],
                      fmt_bytes(info.get("bytes", 0)), when, info["status"] + (" (best)" if info["best"] else ""))
    console.print(table)
    for info in infos:  # below the table, whole: a reason is never cut to a column's width
        if "problem" in info:
            console.print(f"step {info['step']} {info['status']}: {info['problem']}")
    if len(infos) == 1 and "files" in infos[0]:
        files = _table("files", {"file": "left", "bytes": "right", "sha256": "left"})
        for name, rec in infos[0]["files"].items():
            files.add_row(name, f"{rec['bytes']:,}", rec["sha256"][:16] + "...")
        console.print(files)
    return 0 if all("problem" not in i for i in infos) else 1


def _export(args: argparse.Namespace) -> int:
    import safetensors.torch

    from scaletrain.checkpoint import dcp
    from scaletrain.observe.metrics import write_whole
    from scaletrain.train.checkpointing import FORMAT_DCP, TIED, Resume, read_model, read_trainer

    out = Path(args.out)
    if out.exists():
        raise UserError(f"{out}: already exists and is never overwritten; fix: choose a new file name")
    if out.suffix != ".safetensors":
        raise UserError(f"{out}: expected a .safetensors file name; fix: {out.with_suffix('.safetensors')}")
    if problem := dir_problem(out.parent):
        raise UserError(f"{out}: its folder cannot be made or written ({problem}); fix: an OUT in a writable "
                        "place")
    out.parent.mkdir(parents=True, exist_ok=True)
    path, manifest = _best(Path(args.path)) if args.best else _newest_sound(Path(args.path))
    resume = Resume(path, manifest)
    meta = resume.meta
    if meta.get("format") == FORMAT_DCP:  # shards of an FSDP run, consolidated here in one process
        tensors, aliases = dcp.full_tensors(path / dcp.DCP_DIR, "model."), dict(meta.get("aliases", {}))
        tied = {a: b for a, b in dict(meta.get(TIED, {})).items() if a in tensors and b in tensors}
        tensors = {k: v for k, v in tensors.items() if k not in tied}  # a tied weight once, as model.safetensors
        aliases.update(tied)
    else:
        tensors, aliases = read_model(resume)
    if meta.get("session") and not meta.get("bare", True):
        models = read_trainer(resume).get("models", [])
        if len(models) == 1:  # one model with several optimizers: by its own names, as its model.safetensors
            cut = len(models[0]) + 1
            tensors = {k[cut:]: v for k, v in tensors.items()}
            aliases = {a[cut:]: b[cut:] for a, b in aliases.items()}
    header = {"format": "pt", "step": str(resume.step), "config_digest": str(meta.get("config_digest", "")),
              "aliases": json.dumps(aliases)}
    write_whole(out, sum(t.nbytes for t in tensors.values()),  # a full disk: one line, nothing half written
                lambda tmp: safetensors.torch.save_file(tensors, str(tmp), metadata=header))
    n = sum(t.numel() for t in tensors.values())
    print(f"exported step {resume.step} of {path}: {len(tensors)} tensors, {n / 1e6:.3f}M parameters -> {out}"
          + (f" (tied: {', '.join(f'{a} = {b}' for a, b in aliases.items())})" if aliases else ""))
    return 0


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: scaletrain checkpoint --help")
    if args.action == "inspect":
        return _inspect(args)
    if args.action == "export":
        return _export(args)
    raise UserError("checkpoint needs an action: inspect or export; fix: scaletrain checkpoint inspect RUN_DIR")
