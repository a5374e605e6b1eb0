import os
from pathlib import Path

import pytest

# Keep every test's traffic on loopback and each spawned rank on one thread (2 cores here).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs 2 workers, `--dist loadgroup`): a file's tests stay on one worker, so
    its module fixtures (a trained run several tests read) run once; every test that reads the docs tour joins
    one group, so the tour (the longest fixture) runs once too."""
    for item in items:
        group = "docs_tour" if "docs_tour" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(name=group))


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group initialized"


@pytest.fixture(scope="session")
def docs_tour(tmp_path_factory: pytest.TempPathFactory):
    """Every runnable command of README.md and docs/*.md but the slow ones, run once, in order, in a fresh
    workspace (tests/docs_tour.py). Tests that need what a documented command makes (the demo's run, the byo
    example's three runs, a doctor report) read it from here instead of running it again."""
    import docs_tour

    root = docs_tour.workspace(Path(tmp_path_factory.mktemp("docs")) / "checkout")
    return docs_tour.tour([c for c in docs_tour.ALL if not c.slow], root)
