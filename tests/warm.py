"""A warm interpreter for the suite's `scaletrain` commands: torch, its compiler stack and scaletrain imported
once per pytest worker, each command a fork of it set up as a new interpreter would start.

Why: a new `scaletrain` process spends some 2.5-3 s of CPU importing torch, torch._dynamo (an optimizer's first
step imports it) and scaletrain before its first line of work, and the suite starts a few hundred of them (the
docs tour alone some 70) on a 2-core machine that is CPU-bound under `make test`'s two workers. The product's
own workers do the same since cluster/forked.py; this does it for the commands the tests type.

    python tests/warm.py serve SOCKET        the server (conftest.py starts one per pytest worker)
    python tests/warm.py run [-m] ARGS...    a command: `scaletrain ARGS` (`python -m scaletrain ARGS` with -m)

A command is the client's: it passes its standard streams, working directory, environment and argv to the server,
which forks; the fork sets itself up as `scaletrain ARGS` would start (its own session, those streams, that
directory and environment, sys.path from PYTHONPATH, torch's thread count, numpy reseeded), runs the console
script (or the module) as __main__ and leaves through the interpreter's own exit (threads joined, atexit, flush).
The client exits with its exit code (or dies of its signal), forwards the signals it gets, and the fork is
SIGKILLed if the client dies. Where a fork would not be what a new interpreter is, the client runs
scaletrain as a new interpreter instead: no server (SCALETRAIN_TEST_WARM unset, or =0 in the environment of the
run), or an environment that differs from the server's in what torch or Python read as they start (COLD_KEYS).
Tests that signal a launcher's process group, or that time start-up, keep starting real processes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path

SOCKET_ENV = "SCALETRAIN_TEST_WARM"  # the server's socket path; unset or "0": every command a new interpreter
LOG_ENV = "SCALETRAIN_TEST_WARM_LOG"  # a file: one line per command the server was asked for (warm or not)
# What an interpreter (or torch, OpenMP, MKL) reads as it starts: a command whose environment differs from the
# server's in one of these runs as a new interpreter, but for APPLIED: PYTHONPATH, PYTHONUNBUFFERED,
# OMP_NUM_THREADS and TORCHINDUCTOR_CACHE_DIR take the command's values in the fork, PYTHONDONTWRITEBYTECODE and
# PYTHONHASHSEED keep the server's.
COLD_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA", "LD_", "MALLOC", "NCCL")
APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED",
           "TORCHINDUCTOR_CACHE_DIR")  # inductor reads (and sets) it when it first compiles
# What every command imports (an optimizer's first step imports torch._dynamo), and the digits data's loader.
PRELOAD = ("torch", "torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "numpy", "sklearn.datasets", "scaletrain.cli", "scaletrain.train.run")
# What tests run: `scaletrain ARGS` is [*SCALETRAIN, *ARGS], `python -m scaletrain ARGS` is [*SCALETRAIN_M, *ARGS].
SCALETRAIN = [sys.executable, os.path.abspath(__file__), "run"]
SCALETRAIN_M = [*SCALETRAIN, "-m"]
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def commands_dir(socket_path: str) -> Path:
    """The directory (beside the server's socket) whose `scaletrain` is this client (conftest.py writes it)."""
    return Path(socket_path).parent / "bin"


def _send(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
    else:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    got = b""
    while len(got) < n:
        data, anc, _, _ = sock.recvmsg(n - len(got), socket.CMSG_SPACE(3 * struct.calcsize("i")))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) - len(payload) % 4]))
        if not data:
            return None
        got += data
    return got


def _recv(sock: socket.socket, fds: list[int] | None = None) -> dict | None:
    """One message (None: the other end closed); file descriptors passed with it go to ``fds``."""
    fds = [] if fds is None else fds
    head = _recv_exact(sock, 4, fds)
    if head is None:
        return None
    body = _recv_exact(sock, struct.unpack("!I", head)[0], fds)
    return None if body is None else json.loads(body)


# ---------------------------------------------------------------------------------------------------- client


def _cold(module: bool, args: list[str]) -> None:
    if module:
        os.execv(sys.executable, [sys.executable, "-m", "scaletrain", *args])
    script = os.path.join(os.path.dirname(sys.executable), "scaletrain")
    os.execv(script, [script, *args])


def client(module: bool, args: list[str]) -> None:
    path = os.environ.get(SOCKET_ENV, "0")
    if path == "0":
        _cold(module, args)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        _cold(module, args)
    _send(sock, {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}, [0, 1, 2])
    answer = _recv(sock)
    if answer is None or "cold" in answer:
        sock.close()
        _cold(module, args)
    def forward(signum: int, _frame: object) -> None:
        try:
            _send(sock, {"signal": signum})
        except OSError:  # the command has ended: its exit status is on its way
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            done = _recv(sock)
        except InterruptedError:
            continue
        if done is None:  # the server died under it
            sys.stderr.write("warm.py: the warm interpreter went away\n")
            os._exit(1)
        if "exit" in done:
            break
    code = done["exit"]
    if code < 0:  # killed by a signal: die of it too, as the parent of a real process sees it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# ---------------------------------------------------------------------------------------------------- server


def _cold_keys(env: dict[str, str], after: dict[str, str], imported: dict[str, str]) -> list[str]:
    """The keys of ``env`` a new interpreter would start differently with than this server did (``after``: its
    environment once torch was imported; ``imported``: what those imports set themselves, KMP_INIT_AT_FORK...,
    as they would in a new interpreter whose environment lacks them)."""
    keys = {k for k in (*env, *after) if k.startswith(COLD_PREFIXES) and k not in APPLIED}
    return sorted(k for k in keys if env.get(k, imported.get(k)) != after.get(k))


def serve(path: str) -> dict | None:
    """Serve until the parent (the pytest worker) is gone; returns only in a fork, with its request."""
    import importlib

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # bound at once: a command that comes while torch imports waits in the backlog
    listener.listen(64)
    base = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import gc

    gc.freeze()  # the forks' collections leave the server's objects (and their pages) alone
    # what those imports set in the environment (torch: KMP_INIT_AT_FORK, ...), as they would in a new interpreter
    imported = {k: v for k, v in os.environ.items() if k not in base}
    after = dict(os.environ)
    running: dict[int, socket.socket | None] = {}  # fork's pid -> its client's connection (None: client gone)
    while os.getppid() == parent:
        conns = [c for c in running.values() if c is not None]
        ready, _, _ = select.select([listener, *conns], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                fds: list[int] = []
                request = _recv(conn, fds)
                cold = _cold_keys(request["env"], after, imported) if request else ["no request"]
                if base.get(LOG_ENV):  # which commands ran warm, and why the others did not
                    with open(base[LOG_ENV], "a", encoding="utf-8") as log:
                        log.write(json.dumps({"args": request and request["args"], "cold": cold,
                                              "test": request and request["env"].get("PYTEST_CURRENT_TEST")}) + "\n")
                if cold or len(fds) != 3:
                    _send(conn, {"cold": cold})
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    try:
                        listener.close()
                        for other in conns:
                            other.close()
                        _become(request, fds, conn, base, imported)
                    except BaseException:  # noqa: BLE001 -- never a second server: say why, and leave
                        import traceback

                        traceback.print_exc()
                        os._exit(1)
                    return request
                for fd in fds:
                    os.close(fd)
                running[pid] = conn
                _send(conn, {"pid": pid})
                continue
            pid = next(p for p, c in running.items() if c is sock)
            try:
                message = _recv(sock)
            except OSError:
                message = None
            if message is None:  # the client is gone (killed at a timeout): so is its command, with its group
                _kill(pid, signal.SIGKILL, group=True)
                sock.close()
                running[pid] = None
            elif "signal" in message:
                _kill(pid, message["signal"])
        for pid in list(running):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                conn = running.pop(pid)
                if conn is not None:
                    try:
                        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    except OSError:
                        pass
                    conn.close()
    return None


def _kill(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)  # the fork leads a session of its own
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _become(request: dict, fds: list[int], conn: socket.socket, base: dict[str, str],
            imported: dict[str, str]) -> None:
    """In the fork: what `scaletrain ARGS` would be as a new interpreter started by the client."""
    import io

    conn.close()
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update({**imported, **env})
    # sys.path as a new interpreter builds it: the script's directory (the current one for -m), PYTHONPATH, then
    # the installation's own (this server's path without its script's directory and its PYTHONPATH)
    theirs = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = [p for p in sys.path[1:] if p not in theirs]
    head = os.getcwd() if request["module"] else os.path.dirname(sys.executable)
    sys.path[:] = [head, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *installed]
    import importlib
    import tempfile

    from scaletrain.cluster.forked import reseed_as_new

    importlib.invalidate_caches()
    tempfile.tempdir = None  # found again from this environment's TMPDIR when first asked, as a new interpreter does
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            stream = io.TextIOWrapper(io.BufferedReader(raw), encoding=old.encoding, errors=old.errors)
        else:
            tty = os.isatty(fd)
            buffered = raw if unbuffered else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,  # type: ignore[arg-type]
                                      line_buffering=tty or name == "stderr", write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else (os.cpu_count() or 1))
    reseed_as_new()


def run(request: dict) -> None:
    """In the fork: the command, as __main__, then what the interpreter's exit does that a command can see
    (non-daemon threads joined, atexit handlers, streams flushed, the exit code as SystemExit gives it), but not
    its teardown of every module, which in a fork writes to the server's pages (0.5 s of CPU a command)."""
    import atexit
    import runpy
    import threading
    import traceback

    from scaletrain.cluster.forked import leave

    code = 0
    try:
        if request["module"]:
            sys.argv = ["-m", *request["args"]]  # runpy puts the module's path first
            runpy.run_module("scaletrain", run_name="__main__", alter_sys=True)
        else:
            script = os.path.join(os.path.dirname(sys.executable), "scaletrain")
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 -- what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined] -- as the interpreter's exit joins them
        atexit._run_exitfuncs()
    finally:
        leave(code & 0xFF)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        got = serve(sys.argv[2])
        if got is not None:
            del got["env"]
            run(got)
    elif sys.argv[1] == "run":
        rest = sys.argv[2:]
        as_module = bool(rest) and rest[0] == "-m"
        client(as_module, rest[1:] if as_module else rest)
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET | run [-m] ARGS...")
