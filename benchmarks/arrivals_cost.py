"""What reading a rank's collective issue times costs (observe/arrivals.py, the tensor-parallel straggler check):
one read of torch's Flight Recorder holding ``--entries`` collectives (dist.flight_recorder's default: 2,000),
median of ``--repeats``. The session spaces its reads so they take at most 0.5% of the training time.

    python benchmarks/arrivals_cost.py [--entries 2000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE=str(args.entries))
    import torch
    import torch.distributed as dist

    from scaletrain.observe.arrivals import Arrivals

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        t = torch.ones(10)
        for _ in range(args.entries + 100):
            dist.all_reduce(t)
        reader = Arrivals(dist.group.WORLD.group_name)
        times = []
        for _ in range(args.repeats):
            reader._last = 0  # a whole record each time
            started = time.perf_counter()
            reader.read()
            times.append(time.perf_counter() - started)
        print(f"one read of a {args.entries}-entry Flight Recorder: median {1000 * statistics.median(times):.1f} ms "
              f"({args.repeats} repeats)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
