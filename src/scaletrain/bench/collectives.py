"""``scaletrain bench allreduce``, the ranks' side: time each collective at each size, check every result.

Run by every rank of a torchrun job (cli/bench.py starts them through scaletrain.cluster.torchrun.launch, or
the user's own torchrun does). Definitions follow nccl-tests (doc/PERFORMANCE.md):

- size S is the bytes of the whole float32 buffer: the tensor for all_reduce and broadcast, the gathered
  output for all_gather, the input before scattering for reduce_scatter; each rank's share is S / n.
- time: every rank times each iteration (CUDA events on a GPU, a wall clock on the CPU, where Gloo's
  collectives return only when done), after a barrier so that all ranks start together; an iteration's time is
  the slowest rank's, and the reported time is the median over iterations, warm-up excluded.
- algbw = S / time; busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter), x 1
  (broadcast).

Every iteration's result is compared with the exact expected values (small integers in float32, so sums are
exact whatever the reduction order); a wrong result stops the benchmark with an error instead of a number.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.bench.units import OPS, algbw, busbw, format_size
from scaletrain.config import DistConfig
from scaletrain.errors import ConfigError

__all__ = ["OPS", "CollectiveMismatch", "check_backend", "check_sizes", "make_case", "measure", "run_all"]

DTYPE = torch.float32
ELEMENT_BYTES = 4
_PERIOD = 7  # values cycle through rank + 1 + (0..6): misplaced chunks show, sums stay exact in float32

# The newer names where this torch has them (2.13 deprecates the *_into_tensor/_tensor ones).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveMismatch(Exception):
    """A collective returned values other than the exact expected ones (exit code 1)."""


def dist_config(backend: str) -> DistConfig:
    """The one place --backend becomes a device: gloo runs on CPU tensors, nccl on this rank's GPU, auto
    picks nccl on CUDA and gloo elsewhere (scaletrain.runtime.pick_device/pick_backend decide)."""
    device = {"gloo": "cpu", "nccl": "cuda", "auto": "auto"}[backend]
    return DistConfig(device=device, backend=backend)  # type: ignore[arg-type]


def check_backend(backend: str, nproc: int) -> None:
    """Before any worker starts: nccl (asked for, or auto's choice on a CUDA machine) needs one GPU per rank."""
    cuda = torch.cuda.is_available()
    if backend == "gloo" or (backend == "auto" and not cuda):
        return
    if not cuda:
        raise ConfigError("--backend", backend, "gloo or auto on a machine without CUDA (nccl needs GPUs)",
                          "--backend gloo")
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise ConfigError("--nproc", nproc, f"at most {gpus} with --backend {backend} on this machine (nccl: one "
                          f"GPU per rank; NCCL cannot run two ranks on one GPU)", f"--nproc {gpus}, or --backend gloo")


def elements(size_bytes: int, world: int) -> int:
    """float32 elements of the whole buffer: S / 4, rounded down to a multiple of the world size."""
    return size_bytes // ELEMENT_BYTES // world * world


def check_sizes(sizes: list[int], world: int) -> None:
    if elements(sizes[0], world) == 0:
        raise ConfigError("--sizes", format_size(sizes[0]), f"sizes of at least {ELEMENT_BYTES * world} bytes "
                          f"(one float32 per rank for {world} ranks)", "--sizes 1KB..256MB")


def pattern(numel: int, rank: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Rank r's input: r + 1 + ((i + offset) % 7) at index i."""
    index = torch.arange(offset, offset + numel, device=device)
    return (index % _PERIOD + (rank + 1)).to(DTYPE)


def _summed(numel: int, world: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """The sum over ranks of pattern(numel, r, offset): n(n+1)/2 + n x ((i + offset) % 7)."""
    index = torch.arange(offset, offset + numel, device=device)
    return (world * (index % _PERIOD) + world * (world + 1) // 2).to(DTYPE)


@dataclass
class Case:
    """One collective at one size on this rank: run() is timed; reset() and check() are not."""

    op: str
    size_bytes: int  # the whole buffer, after rounding to whole elements per rank
    numel: int
    run: Callable[[], Any]
    reset: Callable[[], Any]
    output: torch.Tensor
    expected: torch.Tensor

    def check(self) -> str | None:
        """None when the output is exactly the expected one, else where it first differs."""
        if torch.equal(self.output, self.expected):
            return None
        bad = (self.output != self.expected).nonzero()
        i = int(bad[0, 0]) if len(bad) else 0
        return (f"{len(bad)} of {self.output.numel()} values wrong; first at index {i}: got "
                f"{self.output[i].item()}, expected {self.expected[i].item()}")


def make_case(op: str, size_bytes: int, rank: int, world: int, device: torch.device) -> Case:
    numel = elements(size_bytes, world)
    chunk = numel // world
    size = numel * ELEMENT_BYTES
    if op in ("all_reduce", "broadcast"):
        source = pattern(numel, rank, device)
        work = torch.empty_like(source)
        expected = _summed(numel, world, device) if op == "all_reduce" else pattern(numel, 0, device)
        run = (lambda: dist.all_reduce(work)) if op == "all_reduce" else (lambda: dist.broadcast(work, src=0))
        return Case(op, size, numel, run, lambda: work.copy_(source), work, expected)  # in place: refill first
    if op == "all_gather":
        inp = pattern(chunk, rank, device, offset=rank * chunk)
        out = torch.empty(numel, dtype=DTYPE, device=device)
        expected = torch.cat([pattern(chunk, r, device, offset=r * chunk) for r in range(world)])
        return Case(op, size, numel, lambda: _all_gather(out, inp), lambda: out.fill_(math.nan), out, expected)
    if op == "reduce_scatter":
        inp = pattern(numel, rank, device)
        out = torch.empty(chunk, dtype=DTYPE, device=device)
        expected = _summed(chunk, world, device, offset=rank * chunk)
        return Case(op, size, numel, lambda: _reduce_scatter(out, inp), lambda: out.fill_(math.nan), out, expected)
    raise AssertionError(f"unknown collective {op}")


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds fn takes on this rank: CUDA events on a GPU (the collective runs on a stream), else the clock."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(case: Case, rank: int, world: int, device: torch.device, *, iters: int, warmup: int) -> dict[str, Any]:
    """Run warmup + iters iterations, check each, and return the median of the slowest rank's times."""
    times, errors = [], []
    for i in range(warmup + iters):
        case.reset()
        dist.barrier()  # all ranks start together, so a time is the collective's, not a late rank's wait
        elapsed = time_once(case.run, device)
        if (error := case.check()) is not None:
            errors.append(f"iteration {i}: {error}")
        if i >= warmup:
            times.append(elapsed)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # an iteration ends when its slowest rank is done
    bad = torch.zeros(world, dtype=torch.int64, device=device)
    bad[rank] = len(errors)
    dist.all_reduce(bad)
    if bad.any():
        ranks = [r for r in range(world) if bad[r]]
        detail = errors[0] if errors else f"rank {ranks[0]} printed the details"
        raise CollectiveMismatch(f"{case.op} of {format_size(case.size_bytes)} on {world} ranks returned wrong "
                                 f"values on rank(s) {ranks}: {detail}")
    per_iter = slowest.tolist()
    median = statistics.median(per_iter)
    return {"op": case.op, "size_bytes": case.size_bytes, "count": case.numel, "dtype": "float32",
            "iters": iters, "warmup": warmup, "time_s": median, "time_min_s": min(per_iter),
            "time_max_s": max(per_iter), "algbw_gb_per_s": algbw(case.size_bytes, median) / 1e9,
            "busbw_gb_per_s": busbw(case.op, case.size_bytes, median, world) / 1e9,
            "checked_iters": warmup + iters}


def run_all(ops: list[str], sizes: list[int], rank: int, world: int, device: torch.device, *, iters: int,
            warmup: int, progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every op at every size, in that order; buffers are freed before the next size is made."""
    results = []
    for op in ops:
        progress(f"{op}: {len(sizes)} sizes, {format_size(sizes[0])} .. {format_size(sizes[-1])}")
        for size in sizes:
            case = make_case(op, size, rank, world, device)
            results.append(measure(case, rank, world, device, iters=iters, warmup=warmup))
            del case
    return results


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[int]]:
    """Columns, rows and the row indices where a new op starts (drawn as a rule)."""
    columns = ["op", "size", "elements", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "checked"]
    rows, sections = [], []
    for i, r in enumerate(results):
        if i and r["op"] != results[i - 1]["op"]:
            sections.append(i)
        rows.append([r["op"], format_size(r["size_bytes"]), f"{r['count']:,}", f"{r['time_s'] * 1e6:,.1f}",
                     f"{r['algbw_gb_per_s']:.3f}", f"{r['busbw_gb_per_s']:.3f}",
                     f"ok x{r['checked_iters']}"])
    return columns, rows, sections


def plot(results: list[dict[str, Any]], path: str, title: str) -> Any:
    from scaletrain.bench.report import line_plot

    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in results:
        xs, ys = series.setdefault(r["op"], ([], []))
        xs.append(r["size_bytes"])
        ys.append(r["busbw_gb_per_s"])
    sizes = sorted({r["size_bytes"] for r in results})
    step = max(1, len(sizes) // 10)  # at most ~10 labels on the size axis
    ticks = sizes[::step]
    return line_plot(path, series, title=title, xlabel="size (bytes of the whole buffer)", ylabel="busbw (GB/s)",
                     logx=True, xticks=(ticks, [format_size(s) for s in ticks]))
