"""A warm interpreter for the suite's commands: torch, its compiler stack and scaletrain imported once per pytest
worker, each command a fork of it set up as a new interpreter would start.

Why: a new `scaletrain` process, or a new worker of a script under `scaletrain launch`, spends some 2.5-3 s of
CPU importing torch, torch._dynamo (an optimizer's constructor imports it) and scaletrain before its first line
of work, and the suite starts a few hundred of them (the docs tour alone some 70) on a 2-core machine that is
CPU-bound under `make test`'s two workers. The product's own workers do the same since cluster/forked.py; this
does it for the commands the tests type and for the Python processes those commands start.

    python tests/warm.py serve SOCKET        the server (conftest.py starts one per pytest worker)
    python tests/warm.py run [-m] ARGS...    a command: `scaletrain ARGS` (`python -m scaletrain ARGS` with -m)
    python tests/warm.py py PYTHON-ARGS...   `python PYTHON-ARGS`: `[-u] SCRIPT ARGS` or `[-u] -m MODULE ARGS`
                                             warm, anything else (-c, other options) a new interpreter

A command is the client's: it passes its standard streams, working directory, environment and argv to the server,
which forks; the fork sets itself up as the command would start (its own session, those streams, that directory
and environment, sys.path as Python builds it from the script's directory or the current one and PYTHONPATH,
torch's thread count, numpy reseeded), runs the console script, script or module as __main__ and leaves through
the interpreter's own exit (threads joined, atexit, flush). Its sys.executable is the directory's `python`, this
client (conftest.py writes it): what it starts with sys.executable (torchrun's agent its workers, verify-resume
and the labs their runs) is warm too, and a launcher's own modules still fork (cluster/forked.own_module matches
sys.executable). The client exits with its exit code (or dies of its signal), forwards the signals it gets, and
the fork is SIGKILLed if the client dies. Where a fork would not be what a new interpreter is, the client runs a
new interpreter instead: no server (SCALETRAIN_TEST_WARM unset, or =0 in the environment of the run), or an
environment that differs from the server's in what torch or Python read as they start (COLD_KEYS). Tests that
signal a launcher's process group, or that time start-up, keep starting real processes.
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
# What torchrun's agent gives each worker under the prefixes above, read when a process group or the elastic agent
# runs, never as torch is imported: a worker's environment may differ from the server's in them.
RUNTIME = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# What every command imports (an optimizer's first step imports torch._dynamo), and the digits data's loader.
PRELOAD = ("torch", "torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "numpy", "sklearn.datasets", "scaletrain.cli", "scaletrain.train.run")
# What tests run: `scaletrain ARGS` is [*SCALETRAIN, *ARGS], `python -m scaletrain ARGS` is [*SCALETRAIN_M, *ARGS].
_HERE = os.path.abspath(__file__)
SCALETRAIN = [sys.executable, _HERE, "run"]
SCALETRAIN_M = [*SCALETRAIN, "-m"]
# `python ARGS` is [*PYTHON, *ARGS]: a script or a module run warm, anything else a new interpreter.
PYTHON = [sys.executable, _HERE, "py"]
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def commands_dir(socket_path: str) -> Path:
    """The directory (beside the server's socket) whose `scaletrain` and `python` are this client (conftest.py
    writes them)."""
    return Path(socket_path).parent / "bin"


def write_commands(socket_path: str) -> None:
    """commands_dir's `scaletrain` and `python`: scripts of this interpreter that run this client."""
    where = commands_dir(socket_path)
    where.mkdir(parents=True, exist_ok=True)
    for name, verb in (("scaletrain", "run"), ("python", "py")):
        shim = where / name
        shim.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[1:1] = [{verb!r}]\n"
                        f"runpy.run_path({_HERE!r}, run_name='__main__')\n")
        shim.chmod(0o755)


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


def scaletrain_command(module: bool, args: list[str]) -> dict:
    """The request for `scaletrain ARGS` (`python -m scaletrain ARGS` with ``module``)."""
    if module:
        return {"main": "module", "target": "scaletrain", "args": args, "unbuffered": False}
    return {"main": "script", "target": os.path.join(os.path.dirname(sys.executable), "scaletrain"), "args": args,
            "unbuffered": False}


def python_command(argv: list[str]) -> dict | None:
    """The request for `python ARGV` where it is a script or a module (options: -u only), else None."""
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    if len(argv) >= 2 and argv[0] == "-m" and not argv[1].startswith("-"):
        return {"main": "module", "target": argv[1], "args": argv[2:], "unbuffered": unbuffered}
    if argv and not argv[0].startswith("-") and os.path.isfile(argv[0]):  # else Python's own error, cold
        # Python runs (and names in tracebacks) the script's path joined to the current directory, not normalized
        # ("dir/../x.py"); sys.argv[0] stays as typed
        return {"main": "script", "target": os.path.join(os.getcwd(), argv[0]), "argv0": argv[0], "args": argv[1:],
                "unbuffered": unbuffered}
    return None


def client(command: dict | None, cold: list[str]) -> None:
    """Run ``command`` (a request: scaletrain_command, python_command) warm, else exec ``cold`` (the same command
    as a new interpreter: its program, then its arguments)."""
    path = os.environ.get(SOCKET_ENV, "0")
    if path == "0" or command is None:
        os.execv(cold[0], cold)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        os.execv(cold[0], cold)
    _send(sock, {**command, "cwd": os.getcwd(), "env": dict(os.environ), "process": process_facts()}, [0, 1, 2])
    answer = _recv(sock)
    if answer is None or "cold" in answer:
        sock.close()
        os.execv(cold[0], cold)

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


def process_facts() -> dict[str, object]:
    """What a fork takes from the server, not from its client, that a command can feel: the Linux namespaces (a
    rehearsal's agent in a network namespace of its own would be forked in the server's), resource limits, CPU
    affinity and identity. The client sends its own; where any differs, the command runs cold."""
    import resource

    facts: dict[str, object] = {}
    for ns in ("net", "mnt", "uts", "ipc", "pid", "user", "cgroup"):
        try:
            facts[f"ns:{ns}"] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            pass
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            facts[name] = list(resource.getrlimit(getattr(resource, name)))
    facts["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    facts["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())]
    facts["umask"] = os.umask(0o022)
    os.umask(facts["umask"])  # type: ignore[arg-type]
    return facts


def _cold_keys(env: dict[str, str], after: dict[str, str], imported: dict[str, str]) -> list[str]:
    """The keys of ``env`` a new interpreter would start differently with than this server did (``after``: its
    environment once torch was imported; ``imported``: what those imports set themselves, KMP_INIT_AT_FORK...,
    as they would in a new interpreter whose environment lacks them)."""
    keys = {k for k in (*env, *after) if k.startswith(COLD_PREFIXES) and k not in APPLIED and not k.startswith(RUNTIME)}
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
    facts = process_facts()
    running: dict[int, socket.socket | None] = {}  # fork's pid -> its client's connection (None: client gone)
    while os.getppid() == parent:
        conns = [c for c in running.values() if c is not None]
        ready, _, _ = select.select([listener, *conns], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                fds: list[int] = []
                request = _recv(conn, fds)
                cold = [*_cold_keys(request["env"], after, imported),
                        *sorted(k for k, v in facts.items() if request["process"].get(k) != v)] \
                    if request else ["no request"]
                if base.get(LOG_ENV):  # which commands ran warm, and why the others did not
                    with open(base[LOG_ENV], "a", encoding="utf-8") as log:
                        log.write(json.dumps({"target": request and request["target"],
                                              "args": request and request["args"], "cold": cold,
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
                        _become(request, fds, conn, base, imported, path)
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
            imported: dict[str, str], path: str) -> None:
    """In the fork: what the request's command would be as a new interpreter started by the client (``path``:
    the server's socket, whose commands_dir `python` becomes sys.executable)."""
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
    # sys.path as a new interpreter builds it: the script's directory, its links resolved (the current one for
    # -m), PYTHONPATH, then the installation's own (this server's path without its script's directory and its
    # PYTHONPATH)
    theirs = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = [p for p in sys.path[1:] if p not in theirs]
    head = os.getcwd() if request["main"] == "module" else os.path.dirname(os.path.realpath(request["target"]))
    sys.path[:] = [head, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *installed]
    import importlib
    import tempfile

    from scaletrain.cluster.forked import reseed_as_new

    importlib.invalidate_caches()
    tempfile.tempdir = None  # found again from this environment's TMPDIR when first asked, as a new interpreter does
    unbuffered = bool(env.get("PYTHONUNBUFFERED")) or request["unbuffered"]
    sys.executable = str(commands_dir(path) / "python")  # what it starts with sys.executable: warm too
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


def _uncaught() -> None:
    """The exception being handled, through sys.excepthook as the interpreter hands it an uncaught one (torch's
    process group prefixes each line with the rank), from the command's first frame: not this file's."""
    kind, err, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename == _HERE:
        tb = tb.tb_next  # none left: the script did not compile, said with no traceback, as Python says it
    sys.excepthook(kind, err.with_traceback(tb) if err is not None else err, tb)  # type: ignore[arg-type]


def _run_script(path: str) -> None:
    """``path`` as `python PATH` runs it: a new __main__ (__file__ the absolute path, __cached__ None, a
    source loader), its code compiled under that name, so tracebacks read as a new interpreter's."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)  # noqa: S102 -- running the script is the point, as `python SCRIPT` does


def run(request: dict) -> None:
    """In the fork: the command, as __main__, then what the interpreter's exit does that a command can see
    (non-daemon threads joined, atexit handlers, streams flushed, the exit code as SystemExit gives it), but not
    its teardown of every module, which in a fork writes to the server's pages (0.5 s of CPU a command)."""
    import atexit
    import runpy
    import threading

    from scaletrain.cluster.forked import exit_code, leave

    code = 0
    try:
        if request["main"] == "module":
            sys.argv = ["-m", *request["args"]]  # as `python -m`: runpy puts the module's path first
            runpy._run_module_as_main(request["target"])  # type: ignore[attr-defined] -- what -m itself calls
        else:
            sys.argv = [request.get("argv0", request["target"]), *request["args"]]  # as typed
            _run_script(request["target"])
    except SystemExit as done:
        code = exit_code(done)
    except KeyboardInterrupt:
        _uncaught()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 -- what the interpreter prints for an uncaught exception
        _uncaught()
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
        args = rest[1:] if as_module else rest
        command = scaletrain_command(as_module, args)  # cold: python -m scaletrain, or the console script
        client(command, [sys.executable, "-m", "scaletrain", *args] if as_module else [command["target"], *args])
    elif sys.argv[1] == "py":
        client(python_command(sys.argv[2:]), [sys.executable, *sys.argv[2:]])
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET | run [-m] ARGS... | py PYTHON-ARGS...")
