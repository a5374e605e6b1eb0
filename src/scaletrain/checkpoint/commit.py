"""The commit protocol: a checkpoint directory is complete, or it is not a checkpoint.

Saving step s:

1. write every file into a staging directory ``ROOT/.tmp-step-<s>-<nonce>/``, each one fsynced;
2. write ``manifest.json`` last: every file's name, size and SHA-256, fsynced, then fsync the directory;
3. rename the staging directory to ``ROOT/step-<s>`` (atomic on POSIX) and fsync ``ROOT``.

A process killed at any instant leaves either no ``step-<s>`` at all (only a staging directory, removed at
the next start) or a complete one. An existing checkpoint is never written to: saving a step that already
exists is refused. Old checkpoints are deleted by first renaming them out of the ``step-*`` namespace, after
a save, or before it when the disk has no room for it otherwise (``make_room``; never the newest valid one). A
``step-*`` directory whose manifest is missing or does not match its files (tampering, a damaged disk) is
moved aside to ``corrupt-step-<s>-<n>`` with a warning, never deleted: nothing already saved is lost.

``ROOT/best.json`` (written whole by a rename, after the checkpoint it names is committed) names the best
checkpoint (checkpoint.best, Session.save_best): pruning and ``make_room`` never delete it.

Any format can use this: the consolidated files of a DDP run, or the shards of a DCP checkpoint written by
every rank into the staging directory before rank 0 writes the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.errors import CheckpointError, free_bytes

MANIFEST = "manifest.json"
BEST = "best.json"
FORMAT = "scaletrain-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_CHUNK = 1 << 22  # bytes per read/write while hashing


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a committed checkpoint directory's name, or None for any other name."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    sha256: str


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes | memoryview) -> FileRecord:
    """Write, hash and fsync one file in a single pass over the bytes."""
    digest = hashlib.sha256()
    view = memoryview(data)
    with open(path, "wb") as f:
        for start in range(0, len(view), _CHUNK):
            chunk = view[start : start + _CHUNK]
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(len(view), digest.hexdigest())


def hash_file(path: Path) -> FileRecord:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(size, digest.hexdigest())


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def new_stage(root: Path, step: int) -> Path:
    """A fresh staging directory for step; it becomes a checkpoint only through ``commit``."""
    root.mkdir(parents=True, exist_ok=True)
    stage = root / f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    return stage


def commit(stage: Path, step: int, records: dict[str, FileRecord], meta: dict[str, Any]) -> Path:
    """Write the manifest last, then rename the staging directory into place. ``records`` are the files the
    caller wrote and hashed; any other file found in ``stage`` (shards other ranks wrote) is hashed here."""
    final = stage.parent / step_name(step)
    if final.exists():
        shutil.rmtree(stage, ignore_errors=True)
        raise CheckpointError(final, "already exists and checkpoints are never overwritten",
                              "resume from it, or use a new --run.dir")
    files = dict(records)
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        name = path.relative_to(stage).as_posix()
        if name not in files and name != MANIFEST:
            fsync_file(path)
            files[name] = hash_file(path)
    for sub in sorted({p.parent for p in stage.rglob("*") if p.is_file()}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(), "meta": meta,
                "files": {name: {"bytes": r.bytes, "sha256": r.sha256} for name, r in sorted(files.items())}}
    write_bytes(stage / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(stage)
    os.rename(stage, final)  # the commit point
    fsync_dir(stage.parent)
    return final


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked for shape (not yet against the files)."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(file, "missing: the save never completed", "resume from an earlier checkpoint")
    try:
        manifest = json.loads(file.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(file, f"unreadable ({err})", "resume from an earlier checkpoint") from None
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
          and isinstance(manifest.get("step"), int))
    if not ok:
        raise CheckpointError(file, "not a scaletrain checkpoint manifest", "point at a step-NNNNNNNN directory")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(file, f"written by a newer scaletrain (format version {manifest['version']})",
                              "upgrade scaletrain to load it")
    return manifest


def verify(path: Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check every file the manifest lists: present, the right size and (``hashes``) the right SHA-256.
    Returns the manifest; the first problem is a CheckpointError naming the file. A step-NNNNNNNN directory
    holds that step: another step's (a renamed directory) would be taken for the newest and resumed from every
    time, its retention deleting the newer real ones."""
    manifest = read_manifest(path)
    named = step_of(path)
    if named is not None and named != manifest["step"]:
        raise CheckpointError(path, f"is named for step {named} but holds step {manifest['step']} (renamed)",
                              f"rename it back to {step_name(manifest['step'])}, or resume from another checkpoint")
    for name, want in manifest["files"].items():
        file = path / name
        if not file.resolve().is_relative_to(path.resolve()):
            raise CheckpointError(file, "the manifest names a file outside the checkpoint", "the manifest was altered")
        if not file.is_file():
            raise CheckpointError(file, "missing", "resume from an earlier checkpoint")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(file, f"{size} bytes, the manifest says {want['bytes']} (truncated or altered)",
                                  "resume from an earlier checkpoint")
        if hashes and hash_file(file).sha256 != want["sha256"]:
            raise CheckpointError(file, "SHA-256 does not match the manifest (damaged or altered)",
                                  "resume from an earlier checkpoint")
    return manifest


def read_verified(path: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file, checked against the manifest as they are read (no second pass, no window
    between a check and a use)."""
    file = path / name
    want = manifest["files"].get(name)
    if want is None:
        raise CheckpointError(file, "not listed in the manifest", "the checkpoint is incomplete or altered")
    try:
        data = file.read_bytes()
    except OSError as err:
        raise CheckpointError(file, f"unreadable ({err.strerror})", "resume from an earlier checkpoint") from None
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise CheckpointError(file, "does not match the manifest (damaged or altered)",
                              "resume from an earlier checkpoint")
    return data


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-* directory under root, oldest first (valid or not)."""
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def clean_stale(root: Path) -> list[Path]:
    """Remove staging and half-deleted directories (and a half-written best.json) left by a process that died;
    returns what it removed."""
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def set_aside(path: Path) -> Path:
    """Move a bad checkpoint out of the step-* namespace, keeping it for inspection."""
    n = 1
    while (aside := path.with_name(f"corrupt-{path.name}-{n}")).exists():
        n += 1
    os.rename(path, aside)
    return aside


def latest_valid(root: Path, warn: Callable[[str], None], *,
                 move: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose manifest matches its files. Newer bad ones are reported and (``move``: a
    resume's; an export only reads) set aside."""
    for _, path in reversed(committed(root)):
        try:
            return path, verify(path)
        except CheckpointError as err:
            aside = f"moved aside to {set_aside(path).name}, " if move else ""
            warn(f"{err.args[0].split('; fix:')[0]}; {aside}falling back to the previous one")
    return None


def prune(root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0 keeps all); never ``protect``, nor the best one."""
    if keep <= 0:
        return []
    spared = {protect, best_path(root)}
    doomed = [p for _, p in committed(root)[:-keep] if p not in spared]
    _delete(doomed)
    return doomed


def write_best(root: Path, step: int, record: dict[str, Any]) -> None:
    """Name ``step-<step>`` (committed) the best checkpoint: ``best.json`` replaced whole, by a rename."""
    tmp = root / f".tmp-{BEST}-{uuid.uuid4().hex[:8]}"
    write_bytes(tmp, json.dumps({"step": step, **record}, indent=1).encode())
    os.rename(tmp, root / BEST)
    fsync_dir(root)


def read_best(root: Path) -> dict[str, Any] | None:
    """What ``best.json`` says (its ``step`` an int), or None without one (or an unreadable one: it only spares a
    checkpoint from deletion, and none is then spared)."""
    try:
        best = json.loads((root / BEST).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("step"), int) else None


def best_path(root: Path) -> Path | None:
    """The directory of the best checkpoint ``best.json`` names (which may since have been set aside)."""
    best = read_best(root)
    return root / step_name(best["step"]) if best is not None else None


def _delete(paths: list[Path]) -> None:
    for path in paths:
        trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)  # out of the step-* namespace at once; the slow delete can be interrupted
        except FileNotFoundError:  # pruned by the other thread (the loop's keep_best, a commit's) meanwhile
            continue
        shutil.rmtree(trash, ignore_errors=True)


def size_of(path: Path) -> int:
    """Bytes of the files under ``path`` (a checkpoint directory), as they are on disk now."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def newest_valid(root: Path) -> Path | None:
    """The newest checkpoint whose files are all there at their manifest's sizes (no hashing: cheap)."""
    for _, path in reversed(committed(root)):
        try:
            verify(path, hashes=False)
            return path
        except CheckpointError:
            continue
    return None


def make_room(root: Path, needed: int, keep: int) -> tuple[list[Path], int]:
    """Before writing a checkpoint of ``needed`` bytes into ``root``: if the disk is short, delete the oldest
    checkpoints that keeping ``keep`` (with the new one) deletes after the save anyway, so that the save can
    fit, but only if that makes room, and never the newest valid checkpoint nor the best one. Returns (what was deleted, the
    bytes free afterwards)."""
    free = free_bytes(root)
    if free >= needed or keep <= 0:
        return [], free
    spared = {newest_valid(root), best_path(root)}
    olds = [p for _, p in committed(root)]
    doomed, freed = [], 0
    for path in olds[: max(0, len(olds) - (keep - 1))]:  # the newest keep - 1 stay beside the new one
        if free + freed >= needed:
            break
        if path not in spared:
            doomed.append(path)
            freed += size_of(path)
    if free + freed < needed:
        return [], free  # not enough even so: keep them, the save is tried (and fails) as it is
    _delete(doomed)
    return doomed, free_bytes(root)
