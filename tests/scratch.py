"""The test session's scratch directory, for runs that no test reads afterwards (a spawned rank's run dir):
conftest.py makes it once per session (the xdist controller's, inherited by its workers and their ranks through
SCALETRAIN_TEST_SCRATCH) and removes it when the session ends. /tmp kept one directory per such run, some 30 a
session."""

from __future__ import annotations

import os
import tempfile

SCRATCH_ENV = "SCALETRAIN_TEST_SCRATCH"


def scratch_dir() -> str:
    """A new directory in the session's scratch directory (in the system's temporary one outside a session)."""
    return tempfile.mkdtemp(prefix="scaletrain-test-", dir=os.environ.get(SCRATCH_ENV) or None)
