"""``scaletrain bench throughput``: training samples/s (tokens/s) and peak memory per device and batch size.

The lecture's first table, reproduced: the same model on the CPU and on a GPU at several batch sizes, to
show that small models and small batches starve a GPU. Each device is measured in a process of its own
(``python -m scaletrain.bench.throughput SPEC OUT``), so one device's threads, CUDA context and memory
never touch another's numbers. In it, for each batch size: build the recipe's job at world size 1, run
``warmup`` steps untimed, then ``repeats`` x ``steps`` timed steps (the device synchronised at both ends of
each repeat); samples/s is the median over repeats. A step is the trainer's own (train/run.py ``step``): the next
batch from the loader, its copy to the device, forward, backward, clipping and the optimizer.

Peak memory is the trainer's measure (scaletrain.observe.metrics.peak_memory_bytes): the CUDA allocator's
peak on a GPU, the peak resident set size on a CPU, reset before each batch size (on Linux through
/proc/self/clear_refs; elsewhere it is the process's peak so far, and the result says so).
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.config import Config, DistConfig, load
from scaletrain.errors import ConfigError, UserError

RESERVED = ("data.batch_size", "train.max_steps", "dist.")  # set by the bench itself, per measurement


@dataclass
class Stepper:
    step: Callable[[], Any]  # one optimizer step; returns without waiting for the device
    samples_per_step: int
    tokens_per_sample: int  # 0 for models that do not read token sequences
    close: Callable[[], None]  # the session closed, its temporary run directory removed


def build_stepper(cfg: Config, device: torch.device) -> Stepper:
    """The one place this module reaches into the trainer: a world-size-1 job built from the config, on its
    session (run dir: a temporary directory; no checkpoints), and a function running one of its steps as
    scaletrain train does (train/run.py step). Close it when done: each batch size's run directory was left
    in /tmp, config.toml and metrics.jsonl, by every `scaletrain bench throughput`."""
    import dataclasses
    import shutil
    import tempfile

    from scaletrain.data import build_splits
    from scaletrain.runtime import Runtime
    from scaletrain.train.run import open_stepper, step

    rt = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, backend="none")
    splits = build_splits(cfg.data, cfg.model)
    run_dir = tempfile.mkdtemp(prefix="scaletrain-bench-")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir),
                              checkpoint=dataclasses.replace(cfg.checkpoint, every=0))
    try:
        job, batches = open_stepper(cfg, rt, splits)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise

    def close() -> None:
        try:
            assert job.st is not None
            job.st.close(finished=False)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    tokens = int(splits.info["seq_len"]) if splits.task == "lm" else 0
    return Stepper(lambda: step(job, batches), job.plan.global_batch, tokens, close)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host-device sync: only at the ends of a timed repeat


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak; False where the OS cannot reset the CPU's (the peak is then the process's so far)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the resident set's high-water mark
        return True
    except OSError:
        return False


def measure_batch(cfg: Config, device: torch.device, *, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    from scaletrain.observe.metrics import peak_memory_bytes

    gc.collect()
    reset = reset_peak_memory(device)
    stepper = build_stepper(cfg, device)
    try:
        for _ in range(warmup):
            stepper.step()
        _sync(device)
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(steps):
                stepper.step()
            _sync(device)
            rates.append(steps * stepper.samples_per_step / (time.perf_counter() - started))
    finally:
        stepper.close()
    samples_per_s = statistics.median(rates)
    result = {"batch_size": cfg.data.batch_size, "samples_per_step": stepper.samples_per_step,
              "samples_per_s": samples_per_s, "samples_per_s_repeats": rates,
              "peak_mem_bytes": peak_memory_bytes(device), "peak_mem_reset": reset}
    if stepper.tokens_per_sample:
        result["tokens_per_s"] = samples_per_s * stepper.tokens_per_sample
    del stepper
    return result


def bench_config(recipe: str, batch_size: int, device: str, total_steps: int,
                 overrides: Mapping[str, str]) -> Config:
    """The recipe at one batch size; the user's --section.key=value overrides on top."""
    return load(recipe, overrides={"data.batch_size": batch_size, "train.max_steps": total_steps,
                                   "dist.device": device}, cli_overrides=overrides)


def check_overrides(overrides: Mapping[str, str]) -> None:
    for key, value in overrides.items():
        if key.startswith(RESERVED):
            raise ConfigError(key, value, "a key the bench does not set itself (it sets data.batch_size from "
                              "--batch-sizes, train.max_steps from the step counts, dist.* from --devices)",
                              "drop it; use --batch-sizes, --steps or --devices instead")


def measure_device(spec: dict[str, Any]) -> dict[str, Any]:
    """Every batch size of the spec on one device, in this process."""
    from scaletrain.runtime import pick_device

    device = pick_device(DistConfig(device=spec["device"]), 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # initialises CUDA: resetting its peak memory before that is an error
    total = spec["warmup"] + spec["repeats"] * spec["steps"]
    rows = []
    for b in spec["batch_sizes"]:
        cfg = bench_config(spec["recipe"], b, spec["device"], total, spec["overrides"])
        try:
            rows.append(measure_batch(cfg, device, steps=spec["steps"], warmup=spec["warmup"],
                                      repeats=spec["repeats"]))
        except ConfigError as err:
            if err.key != "data.batch_size":
                raise
            raise ConfigError("--batch-sizes", b, err.expected, "smaller --batch-sizes") from None
    return {"device": str(device), "name": spec["device"], "threads": torch.get_num_threads(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rows": rows}


def run_devices(spec: dict[str, Any], devices: list[str], workdir: Path) -> list[dict[str, Any]]:
    """One process per device; a device whose process fails ends the benchmark with its exit code."""
    results = []
    for name in devices:
        out = workdir / f"{name.replace(':', '_')}.json"
        proc = subprocess.run([sys.executable, "-m", "scaletrain.bench.throughput",
                               json.dumps({**spec, "device": name}), str(out)], check=False)
        if proc.returncode != 0:
            raise DeviceFailed(name, proc.returncode)
        results.append(json.loads(out.read_text()))
    return results


class DeviceFailed(Exception):
    def __init__(self, device: str, code: int) -> None:
        super().__init__(f"the measurement on {device} exited with code {code}; see its output above")
        self.device, self.code = device, code


def _rate_key(results: list[dict[str, Any]]) -> tuple[str, str]:
    """(JSON key, column unit): tokens/s for sequence models, samples/s otherwise."""
    return ("tokens_per_s", "tokens/s") if "tokens_per_s" in results[0]["rows"][0] else ("samples_per_s", "samples/s")


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The lecture's shape: a row per batch size, a throughput column per device, the GPU/CPU ratio when both
    ran, then peak memory per device."""
    key, unit = _rate_key(results)
    by_device = {r["name"]: {row["batch_size"]: row for row in r["rows"]} for r in results}
    cpu = next((n for n in by_device if n == "cpu"), None)
    gpu = next((n for n in by_device if n.startswith("cuda")), None)
    columns = ["batch size"] + [f"{n} {unit}" for n in by_device]
    if cpu and gpu:
        columns.append(f"{gpu} / {cpu}")
    columns += [f"{n} peak MiB" for n in by_device]
    rows = []
    for b in by_device[results[0]["name"]]:  # every device ran the same batch sizes, ascending
        row = [str(b)] + [f"{by_device[n][b][key]:,.0f}" for n in by_device]
        if cpu and gpu:
            row.append(f"{by_device[gpu][b][key] / by_device[cpu][b][key]:.2f}x")
        row += [f"{by_device[n][b]['peak_mem_bytes'] / 2**20:,.0f}" for n in by_device]
        rows.append(row)
    return columns, rows


def plot(results: list[dict[str, Any]], path: str, title: str) -> Path:
    from scaletrain.bench.report import line_plot

    key, unit = _rate_key(results)
    series = {r["name"]: ([row["batch_size"] for row in r["rows"]], [row[key] for row in r["rows"]])
              for r in results}
    sizes = [row["batch_size"] for row in results[0]["rows"]]
    return line_plot(path, series, title=title, xlabel="batch size (samples per step)", ylabel=unit,
                     logx=True, logy=True, xticks=(sizes, [str(b) for b in sizes]))


def _main(argv: list[str]) -> int:
    spec, out = json.loads(argv[0]), Path(argv[1])
    try:
        out.write_text(json.dumps(measure_device(spec)))
    except UserError as err:
        print(f"scaletrain: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
