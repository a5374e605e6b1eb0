"""What the launcher's environment says about this process, read without importing torch (seconds): the
CLI decides whether it is a worker or the launcher before anything heavy is imported."""

from __future__ import annotations

import os

# "PID EXITCODE" of the worker of this machine that failed last, set by scaletrain's launcher (cluster/
# torchrun.py) for the workers of the restarted group, which inherit its environment.
FAILED_WORKER_ENV = "SCALETRAIN_FAILED_WORKER"


def under_launcher() -> bool:
    """True when a launcher (torchrun, or a compatible one) has set this process's rank and world."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
