import os
import sys
from pathlib import Path

import pytest

# Keep every test's traffic on loopback and each spawned rank on one thread (2 cores here).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# One intra-op thread per process, as torchrun gives its workers: `make test` runs 2 pytest workers on 2 cores,
# and a single-process command (the docs tour's labs, plans and benches) taking both cores beside the other
# worker's ranks oversubscribes them; OpenMP's spinning threads then made those commands 3-5x slower than alone
# (a lab of 11.9 s alone took 39 s in the tour). Set before torch is imported, so the workers' own torch too.
os.environ.setdefault("OMP_NUM_THREADS", "1")


_warm: dict[str, object] = {}  # this pytest process's warm interpreter (tests/warm.py): server, dir; its scratch dir


def pytest_configure(config: pytest.Config) -> None:
    """Where this pytest process's warm interpreter listens (tests/warm.py), set before the test files are
    imported (some build their environment then), and a directory whose `scaletrain` and `python` are its
    client, for commands typed through PATH (the docs tour) and what a warm command starts with sys.executable.
    SCALETRAIN_TEST_WARM=0 runs every command as a new interpreter. And the session's scratch directory
    (tests/scratch.py), removed when it ends."""
    import tempfile

    import warm
    from scratch import SCRATCH_ENV

    if SCRATCH_ENV not in os.environ:  # the session's (the xdist controller's): its workers and ranks inherit it
        os.environ[SCRATCH_ENV] = _warm["scratch"] = tempfile.mkdtemp(prefix="scaletrain-tests-")
    if os.environ.get(warm.SOCKET_ENV) == "0":
        return
    where = Path(tempfile.mkdtemp(prefix="scaletrain-warm-"))
    os.environ[warm.SOCKET_ENV] = str(where / "socket")
    warm.write_commands(os.environ[warm.SOCKET_ENV])
    _warm["dir"] = where


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the warm interpreter if a test that runs commands was collected (a unit test file alone does not
    pay for one)."""
    import subprocess

    import warm

    if "dir" not in _warm or not any(item.path.parent.name == "cli" for item in session.items):
        return
    _warm["server"] = subprocess.Popen([sys.executable, warm.__file__, "serve", os.environ[warm.SOCKET_ENV]],
                                       stdin=subprocess.DEVNULL)
    import time

    deadline = time.monotonic() + 10  # it binds its socket before it imports anything: a first test's command
    while not os.path.exists(os.environ[warm.SOCKET_ENV]) and time.monotonic() < deadline:  # finds it there
        time.sleep(0.01)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    server = _warm.pop("server", None)
    if server is not None:
        server.terminate()  # type: ignore[attr-defined]
        server.wait()  # type: ignore[attr-defined]
    for key in ("dir", "scratch"):
        where = _warm.pop(key, None)
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group initialized"


def _record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the docs tour's record lies, shared by the workers of one session (their base temp's parent)."""
    return tmp_path_factory.getbasetemp().parent / "docs_tour.pickle"


@pytest.fixture(scope="session")
def docs_tour(tmp_path_factory: pytest.TempPathFactory):
    """Every runnable command of README.md and docs/*.md but the slow ones, run once, in order, in a fresh
    workspace (tests/docs_tour.py), for tests/cli/test_docs.py.

    Once per test session: under pytest-xdist (`make test` runs 2 workers, `--dist loadfile`) the worker that
    runs test_docs.py runs the tour in the workers' shared temporary directory, under a file lock, and leaves
    its record there for the readers of what documented commands made (the `documented` fixture)."""
    import docs_tour

    def run(where: Path) -> docs_tour.Tour:
        return docs_tour.tour([c for c in docs_tour.ALL if not c.slow], docs_tour.workspace(where / "checkout"))

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run(Path(tmp_path_factory.mktemp("docs")))
    import pickle

    from filelock import FileLock

    record = _record(tmp_path_factory)
    with FileLock(str(record.with_suffix(".lock"))):
        if record.exists():
            return pickle.loads(record.read_bytes())
        tour = run(record.parent / "docs")
        partial = record.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(tour))
        partial.replace(record)  # whole or absent: a reader never sees half a record
        return tour


@pytest.fixture(scope="session")
def documented(tmp_path_factory: pytest.TempPathFactory):
    """``documented(text)``: a Tour that ran the documented command(s) starting with ``text``, for tests that
    read what it made (the demo's run, the byo example's three runs, a verify-resume report). The docs tour's
    record when the tour has finished (in this worker or the other); else just those commands, run once per
    worker in a workspace of its own. A reader never waits for the tour: blocked on its lock, a worker sat
    idle 90-131 s while the other ran it, where running its own few commands costs 5-15 s."""
    import pickle

    import docs_tour

    record = _record(tmp_path_factory)
    own: dict[str, docs_tour.Tour] = {}  # text -> the commands run here; "" -> the tour's record, once read

    def tour_for(text: str) -> docs_tour.Tour:
        if "" not in own and record.exists():
            own[""] = pickle.loads(record.read_bytes())
        if "" in own:
            return own[""]
        if text not in own:
            cmds = [c for c in docs_tour.ALL if not c.slow and c.text.startswith(text)]
            assert cmds, f"no documented command starts with {text!r}"
            own[text] = docs_tour.tour(cmds, docs_tour.workspace(tmp_path_factory.mktemp("documented")))
        return own[text]

    return tour_for


# Files of the multi-rank and unit group that take over a minute: first in their group, not last on a worker
# while the other has finished (test_plan_parallel.py, ~85 s of fake-tensor planning, ended one worker 35 s
# after the other when it came last in alphabetical order).
LONG_IN_PROCESS = {"test_plan_parallel.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The docs tour's file first, then the other CLI tests, then the files of tests that read what documented
    commands made (the `documented` fixture), then the multi-rank and unit tests: under `make test`'s 2 workers
    (--dist loadfile hands out whole files in this order; --no-loadscope-reorder, as pytest-xdist 3.8 otherwise
    hands out the files with the most tests first, which started the tour 250 s in and its readers before it
    was done: 897 s for the suite where this order took 878 s) the tour runs from the start on one worker, its
    readers come once its record is there (scheduled before it was, each ran its commands again itself: make
    demo, two verify-resumes, a rehearsal, a scaling bench, the byo example three ways), and the many short
    files last keep the two workers' ends level (LONG_IN_PROCESS first among them)."""
    readers = {item.path for item in items if "documented" in getattr(item, "fixturenames", ())}

    def rank(item: pytest.Item) -> int:
        if item.path.name == "test_docs.py":
            return 0
        if item.path.name in LONG_IN_PROCESS:
            return 3
        return 2 if item.path in readers else 1 if item.path.parent.name == "cli" else 4

    items.sort(key=rank)  # stable: each file's tests, and the files within a rank, keep their order
