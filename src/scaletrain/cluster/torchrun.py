"""Starting workers through torchrun's own API (torch.distributed.run), never a home-made spawner.

The launcher process runs torchrun's agent in-process. Around it, launch() takes three things into its own
hands: SIGINT/SIGTERM (a first one stops the job the agent's own way, a second Ctrl-C stops it at once),
torchrun's line about a failed worker (read for the restarted workers, which say what happened in one line),
and the address the agent's key-value stores listen on (its own address, not every interface).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from scaletrain.config import DistConfig
from scaletrain.env import (
    FAILED_WORKER_ENV,
    FAILURE_SAID,
    HELD_SIGNAL_ENV,
    LAUNCH_DIR_ENV,
    dies_with,
    held_signal,
)
from scaletrain.errors import EXIT_USAGE, ConfigError, UserError

# The agent stops the surviving workers with SIGTERM (then SIGKILL): those exits are consequences, not causes.
# A worker that catches SIGTERM (preemption) and then cannot save exits with 128 + SIGTERM instead.
_STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def interface_of(address: str) -> str | None:
    """The name of this machine's interface holding IPv4 ``address`` (Linux's SIOCGIFADDR), or None."""
    import fcntl
    import struct

    try:
        wanted = str(ipaddress.IPv4Address(address))
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == wanted:
                return name
    return None


def _is_local(endpoint: str) -> bool:
    return not endpoint or endpoint.rpartition(":")[0] in ("127.0.0.1", "localhost", "::1", "[::1]")


def _bind_address(host: str) -> str | None:
    """The address a store advertised at ``host`` listens on: that address when it is one (a name could
    resolve to another address here than on the other machines: Debian maps the host name to 127.0.1.1),
    loopback for "localhost"; None (every interface, torch's own way) for any other name."""
    host = host.strip("[]")
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on address:port (0: a free port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store: no wait on TIME_WAIT
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _bound(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make`` (torch's TCPStore), whose server listens on the address it is advertised at: a socket bound
    there is handed over through master_listen_fd (only the libuv server takes one; the store closes it)."""

    def store(host_name: str, port: int, *args: Any, **kwargs: Any) -> Any:
        address = _bind_address(host_name)
        if not kwargs.get("is_master") or args or address is None or "master_listen_fd" in kwargs:
            return make(host_name, port, *args, **kwargs)
        try:
            sock = _listening_socket(address, port)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:  # another agent of this machine hosts it: torch then joins as a client
                raise RuntimeError(f"{address}:{port} is in use ({err})") from err
            return make(host_name, port, *args, **kwargs)  # not an address of this machine: torch's own way
        bound_port, fd = sock.getsockname()[1], sock.detach()
        try:
            return make(host_name, bound_port, *args, **{**kwargs, "master_listen_fd": fd, "use_libuv": True})
        except BaseException:
            os.close(fd)  # a store that failed to start did not take the socket
            raise

    return store


@contextlib.contextmanager
def _stores_on_their_address(fresh: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """While torchrun's agent runs in this process, its TCPStore servers listen on the address each is
    advertised at instead of every interface (torch's TCPStore binds the wildcard address whatever host it is
    given). Two servers: the c10d rendezvous store on the endpoint's host (c10d_rendezvous_backend's
    TCPStore), and the store the workers meet at, on this agent's --local-addr (dynamic_rendezvous's
    _create_tcp_store_server). On one machine both are loopback; on several, the endpoint's address where it
    is given as one, and the second store on dist.local_addr where that is an address of this machine (else
    on every interface: by default its address is the host's name, which the other machines resolve). And where
    ``fresh()`` says so when a round begins, the workers' store is a new one for it (fresh_round). Restored on the
    way out: nothing else in the process is changed."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as Handler

    make = _bound(TCPStore)

    def agent_store(self: Any, master_addr: str, master_port: int) -> Any:
        return make(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True)

    joined = vars(Handler).get("next_rendezvous")

    def fresh_round(self: Any) -> Any:
        # The workers' store anew for this round (a new port): torch made it once and kept it for the job,
        # though its env:// rendezvous counts on a new one per restart ("We create a new TCPStore for every
        # retry"), so a restarted plain script's Gloo ranks could read the addresses of the workers that died
        # under the same keys ("Gloo connectFullMesh failed ... Connection refused", or a hang). Not for
        # scaletrain's own workers: they meet in a namespace of their own in the store (runtime._meet), and read
        # there what the group before them left (which rank died). The old workers are gone by the next round;
        # every node rebuilds its bootstrap info from the round's keys.
        if getattr(self, "_bootstrap_store_info", None) is not None and fresh():
            self._bootstrap_store_info, self._shared_tcp_store_server = None, None
        return joined(self)  # type: ignore[misc]

    # Each only where this torch has it: all are torch's private names (as of 2.13).
    patches = [(obj, name, new) for obj, name, new in ((c10d, "TCPStore", make),
                                                      (Handler, "_create_tcp_store_server", agent_store),
                                                      (Handler, "next_rendezvous", fresh_round))
               if name in vars(obj)]
    before = [(obj, name, vars(obj)[name]) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in before:
            setattr(obj, name, old)


@contextlib.contextmanager
def _worker_processes(fork: bool) -> Iterator[None]:
    """While torchrun's agent runs in this process, each worker it starts asks Linux, between fork and exec, to
    SIGKILL it when this process dies (PR_SET_PDEATHSIG), so a launcher that is SIGKILLed (the OOM killer, a
    scheduler's kill -9) takes its workers: a plain torchrun script's workers otherwise trained on as orphans (a
    session's ask for it themselves, env.die_with_launcher, but only once they have imported scaletrain). A
    worker forked after this process died exits at once. ``fork``: a worker running scaletrain's own module
    (forked.own_module; a user's script never) is a fork of this process instead of a new interpreter. Linux
    only; the agent's _popen is torch's private name (as of 2.13): where this torch has another, nothing
    changes."""
    import subprocess

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as handler

    from scaletrain.cluster import forked

    original = vars(handler.SubprocessHandler).get("_popen")
    arm = dies_with(os.getpid())  # run in the child, between fork and exec
    if original is None or (arm is None and not fork):
        yield
        return

    def _popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        if not hasattr(self, "_stdout") or not hasattr(self, "_stderr"):
            return original(self, args, env)
        if fork and (own := forked.own_module(args)) is not None:
            return forked.start(args, *own, env, self._stdout, self._stderr, arm)
        if arm is None:
            return original(self, args, env)
        return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr, start_new_session=True,
                                preexec_fn=arm)  # noqa: PLW1509 -- nothing but a system call in the child

    handler.SubprocessHandler._popen = _popen
    try:
        yield
    finally:
        handler.SubprocessHandler._popen = original


def torchrun_args(cfg: DistConfig, target: list[str], *, module: bool, run_id: str) -> list[str]:
    """torchrun's options for this machine's workers and the script (or module) ``target[0]``."""
    args = [f"--nproc-per-node={cfg.nproc}", f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint or '127.0.0.1:0'}", f"--rdzv-id={cfg.rdzv_id or run_id}",
            f"--max-restarts={cfg.max_restarts}", f"--rdzv-conf=join_timeout={cfg.rdzv_timeout_s}"]
    if _is_local(cfg.rdzv_endpoint):
        # The address this agent gives its workers as MASTER_ADDR; the default would be the host's FQDN.
        args.append("--local-addr=127.0.0.1")
    elif cfg.local_addr:  # this machine's address on the job's network: the workers' store listens there only
        args.append(f"--local-addr={cfg.local_addr}")
    return args + (["-m"] if module else []) + target[:1]


def check_socket_ifname() -> None:
    """GLOO_SOCKET_IFNAME naming no interface of this machine (a typo, another machine's name): every worker
    died in its first collective with a traceback ('Unable to find address for: ...'). Said in one line before
    they start, in `scaletrain doctor`'s words (cluster/doctor.py)."""
    from scaletrain.cluster.doctor import ifname_problem

    var = "GLOO_SOCKET_IFNAME"
    if problem := ifname_problem(var, os.environ.get(var), [name for _, name in socket.if_nameindex()]):
        raise UserError(f"{problem[0]}; fix: {problem[1]}")


def check_endpoint(cfg: DistConfig) -> None:
    """What can be told of the rendezvous endpoint before any agent starts: a host name that does not resolve
    (torch retried it for 60 s and printed some 50 lines of C++ frames), and on one machine, where this agent hosts
    the rendezvous, a port another process holds (torch then joined that process as a client and waited on it
    forever, deaf to Ctrl-C)."""
    if not cfg.rdzv_endpoint:
        return
    host, _, port = cfg.rdzv_endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError("dist.rdzv_endpoint", cfg.rdzv_endpoint, f"a host this machine can resolve ({host}: "
                          f"{getattr(err, 'strerror', None) or err})",
                          "the name or address of the first machine, as every machine resolves it") from None
    if cfg.nnodes != 1:
        return
    # torch's store listens on every interface for a name that is not an address (the machine's own host name):
    # a port held on any of them stops it, which the wildcard address finds
    address = _bind_address(host) or ("::" if found[0][0] == socket.AF_INET6 else "0.0.0.0")
    try:
        _listening_socket(address, int(port)).close()
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ConfigError("dist.rdzv_endpoint", cfg.rdzv_endpoint, "a free port: with one machine this agent "
                              "hosts the rendezvous there, and another process holds it",
                              f"--rdzv-endpoint={host}:{_free_port(address)}, or leave it out (a free port is "
                              "picked)") from None


def _free_port(address: str) -> int:
    with _listening_socket(address, 0) as sock:
        return int(sock.getsockname()[1])


def _exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"failed with exit code {exitcode}"


def _recorded(failure: Any) -> str:
    """The exception a worker recorded in its error file (a script's main under torch's @record), in one line of
    at most 200 characters; '' when it recorded none (torch then makes up a pointer to its docs, or names a
    signal, which the exit text says already)."""
    if not os.path.isfile(str(getattr(failure, "error_file", ""))):
        return ""
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    first = str(message).strip().splitlines()[0] if str(message).strip() else ""
    return first if len(first) <= 200 else first[:197] + "..."


def root_failure(failures: dict[int, Any]) -> tuple[int, int]:
    """(global rank, exit code) of the worker that most likely failed first.

    A worker the agent stopped because another one failed comes last; then the earliest failure (torch
    records whole seconds); within the same second a worker killed by a signal (SIGKILL, the OOM killer) before
    one that exited with an error (a survivor reporting the collective its dead peer left), then the lowest rank.
    """
    first = min(f.timestamp for f in failures.values())
    rank = min(failures, key=lambda r: (_by_agent(failures[r], first), failures[r].timestamp,
                                        failures[r].exitcode >= 0, r))
    return rank, failures[rank].exitcode


def _by_agent(failure: Any, first: float) -> bool:
    """Whether the agent stopped this worker because another one failed (at ``first``, the earliest failure)."""
    # The agent's SIGKILL follows its SIGTERM by the shutdown timeout (>= 30 s): one sooner came from elsewhere.
    return failure.exitcode in _STOPPED_BY_AGENT and not (
        failure.exitcode == -signal.SIGKILL and failure.timestamp - first < 30)


def _quiet_agent_logs() -> None:
    """Keep torchrun's agent to errors: its loggers set their own level (WARNING, or $LOGLEVEL), so a parent's
    level would not reach them, and at WARNING it reports routine events (the heartbeat of an agent whose
    peer already finished, the stopping of workers). Worker failures and rendezvous errors reach the user
    as one scaletrain line instead; set LOGLEVEL (e.g. INFO) to see the agent's own account."""
    if "LOGLEVEL" in os.environ:
        return
    # Imported first so that the loggers they create at import time exist when the levels are set.
    for module in ("torch.distributed.run", "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
                   "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"):
        importlib.import_module(module)
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.ERROR)


def _agent_args(cfg: DistConfig, target: list[str], *, module: bool, run_id: str) -> Any:
    """torchrun's parsed arguments, with SIGINT and SIGTERM left to _Stop and time for the workers to save."""
    from torch.distributed import run as torchrun

    parsed = torchrun.get_args_parser().parse_args(torchrun_args(cfg, target, module=module, run_id=run_id))
    # Set, not parsed: torchrun's parser would read the script's own --options (abbreviations included).
    parsed.training_script_args = target[1:]
    if hasattr(parsed, "signals_to_handle"):  # newer torchrun; an older agent keeps SIGINT and SIGTERM itself
        parsed.signals_to_handle = "SIGHUP,SIGQUIT"
    if hasattr(parsed, "shutdown_timeout") and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        # How long the agent waits for stopped workers before SIGKILL (torchrun: 30 s): long enough to save a
        # checkpoint. A worker that cannot save exits by itself (train/preempt.py's watchdog).
        parsed.shutdown_timeout = max(30, cfg.timeout_s)
    return parsed


def launch(cfg: DistConfig, target: list[str], *, module: bool = False, run_id: str = "scaletrain",
           trainer: bool = False, after_stop: Callable[[int], int | None] | None = None,
           usage_said: Callable[[], bool] | None = None, plain: Callable[[], bool] = lambda: False) -> int:
    """Start cfg.nproc workers on this machine and wait for them; returns the job's exit code: the failed
    worker's own (1 when a signal killed it), 128 + the signal when this process was stopped by one.

    On one machine everything stays on loopback: the agent's stores (which torch would have listen on every
    interface: _stores_on_their_address), MASTER_ADDR, and Gloo's sockets (GLOO_SOCKET_IFNAME), which would
    otherwise bind the address the host name resolves to. On several, given dist.local_addr, Gloo's and NCCL's
    sockets use the interface holding it (unless GLOO_/NCCL_SOCKET_IFNAME say otherwise). Every agent of
    a multi-machine job must pass the same run_id (cfg.rdzv_id wins over it). ``trainer``: the workers run
    scaletrain's trainer, which reports a stop and a restart itself; this process then prints nothing when
    signalled and drops torchrun's line about a failed worker. ``after_stop(signum)``: once a stop signal to this
    process has ended the workers, says what they did and returns the exit code (None: this process says they
    were stopped, 128 + signum). ``usage_said``: whether a worker's exit code 2 was scaletrain's one-line usage
    error (default: taken to be); else it is a failure like any other, and said. ``plain``: whether the workers
    run a script that opened no scaletrain session (its restarted workers then meet in a new store). While this
    runs, LAUNCH_DIR_ENV names a directory of its own, where the workers tell it what they said (env.tell_launcher).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from scaletrain.cluster import forked

    if _is_local(cfg.rdzv_endpoint) and (lo := _loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    elif cfg.local_addr and (nic := interface_of(cfg.local_addr)):
        # Gloo's and NCCL's sockets on the interface of the address the job was given, not the one the host
        # name resolves to (a management network, or none at all inside a container or namespace).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", nic)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", nic)
    # torchrun would set 1 and print a banner about it; on CPUs give each worker its share of the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    check_socket_ifname()
    check_endpoint(cfg)
    forked.check_start()
    _quiet_agent_logs()
    parsed = _agent_args(cfg, target, module=module, run_id=run_id)
    if cfg.nnodes > 1:  # the wait can be long: say what this agent waits for, and how long it will
        print(f"scaletrain: waiting at {cfg.rdzv_endpoint} for the {cfg.nnodes} machines of the job (up to "
              f"{cfg.rdzv_timeout_s} s: --dist.rdzv_timeout_s)", file=sys.stderr, flush=True)
    stop = _Stop()
    failures = _FailedWorker(drop=trainer)
    failure_log = logging.getLogger(_FAILURE_LOGGER)
    failure_log.addFilter(failures)
    handlers = {signal.SIGUSR1: _forward_to_workers, signal.SIGINT: stop, signal.SIGTERM: stop}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    if signum := held_signal():  # it came while this process was starting: the workers take it as they start
        os.environ[HELD_SIGNAL_ENV] = str(signum)
    notes, outer = tempfile.mkdtemp(prefix="scaletrain-launch-"), os.environ.get(LAUNCH_DIR_ENV)
    os.environ[LAUNCH_DIR_ENV] = notes  # the workers inherit it
    try:
        with _stores_on_their_address(plain), _worker_processes(forked.can_fork()):
            torchrun.run(parsed)
    except ChildFailedError as err:
        rank, code = root_failure(err.failures)
        if code == EXIT_USAGE and (usage_said is None or usage_said()):
            return EXIT_USAGE  # a usage error: the worker said it in one line, once for the job
        if code > 0 and _said_in_last_round(os.path.join(notes, FAILURE_SAID), cfg.max_restarts):
            # a worker said why training failed, in one line, once for the job (a rank that hung, say); this
            # line would name the first rank to exit, which is not the cause. A worker killed by a signal (the
            # OOM killer) is still said: no worker could say that of itself
            return 1
        first = min(f.timestamp for f in err.failures.values())  # those the agent stopped are not failures
        failed = sum(not _by_agent(f, first) for f in err.failures.values()) or len(err.failures)
        said = _recorded(err.failures[rank])
        print(f"scaletrain: worker rank {rank} {_exit_text(code)}{': ' + said if said else ''} ({failed} of "
              f"{cfg.nproc * cfg.nnodes} workers stopped with an error; see its output above)", file=sys.stderr)
        # the worker's own exit code, as `python script.py` gives it (argparse's 2, a script's sys.exit(3)), for
        # the shell or scheduler that reads it; torchrun exits 1 whatever it was. Killed by a signal: 1
        return code if code > 0 else 1
    except RendezvousError as err:
        why = " ".join(f"{err} {err.__cause__ or ''}".split())  # one line: the cause may span several
        if type(err).__name__ == "RendezvousTimeoutError" and not why:
            why = f"not every machine arrived within {cfg.rdzv_timeout_s} s (--dist.rdzv_timeout_s)"
        where = cfg.rdzv_endpoint or "this machine"
        # A lost connection also ends every other machine's agent once the job has failed or stopped on the
        # machine that hosts the rendezvous (its agent exits and takes the store with it): say both.
        lost = "if the job had started, it ended on the machine hosting the rendezvous: see that machine's " \
            "output (or scaletrain diagnose RUN_DIR); else " if type(err).__name__ == "RendezvousConnectionError" \
            and cfg.nnodes > 1 else ""
        print(f"scaletrain: rendezvous at {where} failed ({type(err).__name__}: {why}); fix: {lost}check that "
              f"the endpoint is reachable from every machine and that all {cfg.nnodes} machines run the "
              "same command", file=sys.stderr)
        return 1
    except SignalException as err:
        return stop.stopped(int(err.sigval), say=not trainer, after=after_stop)
    except Exception:
        # Our SignalException raised between two lines of torchrun's metrics wrapper comes out of it as an
        # UnboundLocalError (its finally reads a name not yet assigned); the agent still shut the workers
        # down on its way out, so it is the same stop.
        if not stop.signum:
            raise
        return stop.stopped(stop.signum, say=not trainer, after=after_stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        failure_log.removeFilter(failures)
        failures.forget()
        if outer is None:
            del os.environ[LAUNCH_DIR_ENV]
        else:
            os.environ[LAUNCH_DIR_ENV] = outer
        shutil.rmtree(notes, ignore_errors=True)
    return 0


def _said_in_last_round(path: str, max_restarts: int) -> bool:
    """Whether a worker of the job's last round (restart count max_restarts: the agent gives up after it) said
    its failure (errors.report wrote FAILURE_SAID with its round); one of an earlier round does not count."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() == str(max_restarts)
    except OSError:
        return False


class _Stop:
    """This process's SIGINT and SIGTERM, in place of torchrun's handler (which takes every one as a reason to
    stop the agent again). The first one raises torchrun's SignalException, as its handler does: the agent
    passes the signal on to every worker (scaletrain's save a checkpoint at the step they agree on and exit),
    restarts nothing, waits for them up to its shutdown timeout, and re-raises. A later SIGINT, a second
    Ctrl-C, kills the workers at once; a later SIGTERM changes nothing (the workers already stop)."""

    def __init__(self) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self._raise = SignalException
        self.signum = 0  # the first signal, 0 = none
        self.killed = False  # a second Ctrl-C killed the workers

    def stopped(self, signum: int, *, say: bool, after: Callable[[int], int | None] | None = None) -> int:
        """The launcher's exit code after the stop: ``after(signum)``'s, having said it, or 128 + the signal;
        ``say``: then one line about the workers."""
        if after is not None and (code := after(signum)) is not None:
            return code
        if say:
            how = "a second Ctrl-C killed the workers" if self.killed else "the workers were stopped too"
            print(f"scaletrain: stopped by {signal.Signals(signum).name}; {how}", file=sys.stderr)
        return 128 + signum

    def __call__(self, signum: int, frame: object) -> None:
        # Raw writes to stderr: a print here could re-enter a stream the interrupted code was writing.
        if not self.signum:
            self.signum = signum
            if signum == signal.SIGINT:
                # the launcher cannot tell a worker training through scaletrain from any other script's: both said
                os.write(2, b"scaletrain: Ctrl-C: stopping the workers (training through scaletrain saves a "
                            b"checkpoint first; any other script stops as its own SIGINT handling does); Ctrl-C "
                            b"again: stop them now\n")
            raise self._raise(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        if signum == signal.SIGINT and not self.killed:
            self.killed = True
            os.write(2, b"scaletrain: Ctrl-C again: killing the workers now, without a checkpoint (the last "
                        b"committed one stays whole)\n")
            _signal_workers(signal.SIGKILL)


_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _FailedWorker(logging.Filter):
    """Reads torchrun's "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s" as the agent logs it,
    before it restarts the group, and leaves "PID EXITCODE" in this process's environment, which the restarted
    workers inherit (env.FAILED_WORKER_ENV): their rank 0 then names the worker that died, how, and where
    the job goes on from, in one line. ``drop``: that line replaces torchrun's (LOGLEVEL set keeps it)."""

    def __init__(self, *, drop: bool) -> None:
        super().__init__()
        self.drop = drop and "LOGLEVEL" not in os.environ
        self._before = os.environ.get(FAILED_WORKER_ENV)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not (str(record.msg).startswith("failed (exitcode") and len(args) >= 3):
            return True
        exitcode, _, pid = args[:3]
        os.environ[FAILED_WORKER_ENV] = f"{pid} {exitcode}"
        return not (self.drop or exitcode == EXIT_USAGE)  # exit 2: the worker's one line says it all

    def forget(self) -> None:
        """Put this process's environment back as it was."""
        if self._before is None:
            os.environ.pop(FAILED_WORKER_ENV, None)
        else:
            os.environ[FAILED_WORKER_ENV] = self._before


def _children(pid: int) -> list[int]:
    """The processes pid started (Linux /proc; elsewhere none)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc; elsewhere none)."""
    return [p for child in _children(pid) for p in (child, *_descendants(child))]


def _forward_to_workers(signum: int, frame: object) -> None:
    """Slurm's --signal=USR1@T reaches every process of the step, but a user's `kill -USR1` reaches only this
    one, whose default action would end the agent and orphan the workers: pass it on to them instead. The
    workers treat it as preemption (save, exit 0). Before there are any (the agent at its rendezvous, or between
    two rounds of workers), the workers it starts next take it (env.py held_signal)."""
    workers = _descendants(os.getpid())
    if not workers:
        os.environ[HELD_SIGNAL_ENV] = str(signum)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _signal_workers(signum: int) -> None:
    """Send signum to every worker and what it started (its data loader workers): torchrun starts each worker
    as the leader of a process group of its own."""
    for pid in _children(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
