"""When a job hangs or a rank dies: what every rank was doing, and `scaletrain diagnose RUN`'s one line.

Every rank keeps torch's Flight Recorder (dist.flight_recorder entries: each collective it entered, with its
process group, sequence number, sizes and Python stack; on Gloo as on NCCL in torch >= 2.7). When a collective
fails or times out, the rank that sees it (runtime.collective_failure) writes its record to
RUN_DIR/flight/rank-NNNNN.json and raises a flag in the job's store; every other rank's watcher thread sees the
flag within half a second and writes its own, with the Python stack of its main thread: the rank that hangs
(in a collective, or before one, in a sleep or a loop) says where it is. The thread polls the store twice a
second while the run lasts (one small request, off the training loop) and is a daemon.

diagnose() reads the records: per process group, the last collective each rank entered; ranks behind the
others did not reach the next one, and their stacks say where they were instead.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIR = "flight"
FLAG = "dump"  # under scaletrain/<attempt>/ in the job's store: set by the first rank that saw a failure


def enable(entries: int) -> None:
    """Before the process group starts: keep the last ``entries`` collectives (0: off)."""
    if entries <= 0:
        return
    import torch

    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    # torch >= 2.7 reads TORCH_FR_BUFFER_SIZE (and warns on every rank about the older name); before, NCCL's name
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 7) else "TORCH_NCCL_TRACE_BUFFER_SIZE",
                          str(entries))


def enabled() -> bool:
    return any(int(os.environ.get(k, "0") or 0) > 0 for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"))


def _recorded() -> dict[str, Any]:
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        return pickle.loads(_dump_fr_trace(True, True))
    except Exception as err:  # noqa: BLE001 -- a private API that may be missing or off: say so in the dump
        return {"error": f"{type(err).__name__}: {err}", "entries": []}


def _main_stack() -> list[dict[str, Any]]:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return []
    return [{"file": f.filename, "line": f.lineno, "name": f.name, "code": f.line or ""}
            for f in traceback.extract_stack(frame)]


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    if isinstance(node, bytes):
        return node.decode(errors="replace")
    return node


def dump(run_dir: Path, rank: int, *, reason: str, step: int | None = None) -> Path:
    """This rank's record (the Flight Recorder's entries and its main thread's stack), written whole."""
    record = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "reason": reason, "step": step,
              "time": time.time(), "stack": _main_stack(), "recorder": _plain(_recorded())}
    path = run_dir / DIR / f"rank-{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    tmp.replace(path)
    return path


class Watcher:
    """A daemon thread that writes this rank's record once another rank raised the store's flag."""

    def __init__(self, store: Any, key: str, run_dir: Path, rank: int, step: Any) -> None:
        self.store, self.key, self.run_dir, self.rank, self.step = store, key, run_dir, rank, step
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="scaletrain-flight", daemon=True)
        self._thread.start()
        _live.add(self)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                if not self.store.check([self.key]):
                    continue
                asked = self.store.get(self.key).decode()
            except Exception:  # noqa: BLE001 -- the store went away (the job is ending): nothing to watch
                return
            if not self.done.is_set() and asked != str(self.rank):  # the asking rank wrote its own
                self.done.set()
                dump(self.run_dir, self.rank, reason=f"asked by rank {asked}, whose collective failed",
                     step=self.step())
            return

    def stop(self) -> None:
        """Before the process group ends: a thread still inside a store call at interpreter exit aborts the
        process ("terminate called without an active exception")."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        _live.discard(self)


_live: set[Watcher] = set()  # started and not stopped: a session closes its own; stop_all() the rest


def stop_all() -> None:
    """Stop every watcher still running, before the process group ends (runtime.close). A session left open
    keeps its watcher, and through the watcher's step callback the session and its DDP wrapper, whose Gloo
    threads then abort the process at exit (the SIGABRT runtime.close describes)."""
    for watcher in list(_live):
        watcher.stop()


# -- diagnose --------------------------------------------------------------------------------------------------


@dataclass
class Finding:
    line: str  # the one-line verdict
    details: list[str]  # what each rank was doing


def _where(stack: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch and the interpreter's own modules: the code that was running."""
    skip = (f"{os.sep}torch{os.sep}", f"{os.sep}threading.py", f"{os.sep}contextlib.py")
    for f in reversed(stack):
        if not any(s in f["file"] for s in skip):
            return f"{f['file']}:{f['line']} in {f['name']}" + (f" ({f['code']})" if f.get("code") else "")
    return "an unknown place (no Python stack)"


def _entries(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in record.get("recorder", {}).get("entries", []) if not e.get("is_p2p")]


def _collective(entry: dict[str, Any]) -> str:
    group = entry.get("process_group", ["", ""])
    sizes = entry.get("input_sizes") or []
    return (f"collective #{entry['collective_seq_id']} ({entry.get('profiling_name', '?')}"
            f"{' ' + str(sizes) if sizes else ''} on group {group[1] or group[0]})")


def diagnose(run_dir: Path, world_size: int | None = None) -> Finding:
    """Which rank(s) did not reach which collective, and where they were, from RUN_DIR/flight/."""
    from scaletrain.errors import UserError

    folder = run_dir / DIR
    files = sorted(folder.glob("rank-*.json")) if folder.is_dir() else []
    if not files:
        raise UserError(f"{folder}: no flight records (written when a collective fails or times out, with "
                        "dist.flight_recorder > 0); fix: the run directory of a job that hung or lost a rank")
    records = {}
    for path in files:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"{path}: not a flight record ({err}); fix: remove it and diagnose the rest") from None
        records[int(record["rank"])] = record
    world = world_size or max(records) + 1
    silent = [r for r in range(world) if r not in records]
    # per process group: the last collective each rank entered
    last: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for rank, record in records.items():
        for e in _entries(record):
            key = tuple(e.get("process_group", ["", ""]))
            mine = last.setdefault(key, {})  # type: ignore[arg-type]
            if rank not in mine or e["collective_seq_id"] > mine[rank]["collective_seq_id"]:
                mine[rank] = e
    behind: dict[int, tuple[dict[str, Any], dict[str, Any] | None]] = {}  # rank -> (the collective it missed, its last)
    for per_rank in last.values():
        ahead = max(per_rank.values(), key=lambda e: e["collective_seq_id"])
        for rank in records:
            mine = per_rank.get(rank)
            if mine is None and ahead.get("process_group", ["0"])[0] != "0":
                continue  # a subgroup this rank is not in
            late = mine is None or mine["collective_seq_id"] < ahead["collective_seq_id"]
            if late and (rank not in behind or ahead["collective_seq_id"] > behind[rank][0]["collective_seq_id"]):
                behind[rank] = (ahead, mine)
    details = []
    for rank in sorted(records):
        record = records[rank]
        entries = _entries(record)
        newest = max(entries, key=lambda e: e["time_created_ns"]) if entries else None
        did = _collective(newest) if newest else "no collective"
        # a rank that saw the failure was inside its collective: where that was called from says more
        frames = [{"file": f["filename"], "line": f["line"], "name": f["name"]} for f in (newest or {}).get("frames", [])]
        at = _where(list(reversed(frames))) if frames and rank not in behind else _where(record["stack"])
        details.append(f"rank {rank} ({record['host']}, pid {record['pid']}): last entered {did}, called at {at}; "
                       f"{record['reason']}")
    for rank in silent:
        details.append(f"rank {rank}: wrote no record (dead, or killed before it could)")
    if behind:
        parts = []
        for rank in sorted(behind):
            missed, _ = behind[rank]
            parts.append(f"rank {rank} ({records[rank]['host']}) did not reach {_collective(missed)}, at "
                         f"{_where(records[rank]['stack'])}")
        others = sorted(set(records) - set(behind))
        waited = f"rank {others[0]} waited" if len(others) == 1 else f"ranks {', '.join(map(str, others))} waited"
        line = "; ".join(parts) + (f"; {waited} in it" if others else "")
    elif silent:
        line = (f"rank(s) {', '.join(map(str, silent))} wrote no record: dead or killed (the others' last collectives "
                "match)")
    else:
        line = "every rank reached the same last collective: the failure was in it (a peer's connection, a timeout)"
    if silent and behind:
        line += f"; rank(s) {', '.join(map(str, silent))} wrote no record"
    return Finding(line, details)
