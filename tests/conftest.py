import os
from pathlib import Path

import pytest

# Keep every test's traffic on loopback and each spawned rank on one thread (2 cores here).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group initialized"


@pytest.fixture(scope="session")
def docs_tour(tmp_path_factory: pytest.TempPathFactory):
    """Every runnable command of README.md and docs/*.md but the slow ones, run once, in order, in a fresh
    workspace (tests/docs_tour.py). Tests that need what a documented command makes (the demo's run, the byo
    example's three runs, a doctor report) read it from here instead of running it again.

    Once per test session: under pytest-xdist (`make test` runs 2 workers, `--dist loadfile`) the first worker
    to need it runs the tour in the workers' shared temporary directory, under a file lock, and the others
    read its record (the tour is the longest fixture: run per worker, it cost a worker 4 minutes)."""
    import docs_tour

    def run(where: Path) -> docs_tour.Tour:
        return docs_tour.tour([c for c in docs_tour.ALL if not c.slow], docs_tour.workspace(where / "checkout"))

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run(Path(tmp_path_factory.mktemp("docs")))
    import pickle

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the same for every worker of this session
    record = shared / "docs_tour.pickle"
    with FileLock(str(shared / "docs_tour.lock")):
        if record.exists():
            return pickle.loads(record.read_bytes())
        tour = run(shared / "docs")
        record.write_bytes(pickle.dumps(tour))
        return tour
