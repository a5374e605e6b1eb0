import os

import pytest

# Keep every test's traffic on loopback and each spawned rank on one thread (2 cores here).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test left a process group initialized"
