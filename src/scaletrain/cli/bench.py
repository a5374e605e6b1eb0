"""`scaletrain bench allreduce|throughput|scaling`: measure what each step of scale costs (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.bench.units import parse_choice, parse_int, parse_ints, parse_names, parse_sizes
from scaletrain.config import CLI, all_keys, recipe_names, unknown_key
from scaletrain.errors import ConfigError, UserError

HELP = "Measure collective bandwidth, training throughput per device, and scaling with the number of ranks."
_DEFAULT_DEVICES = "cpu,cuda"


def add_parser(sub: Any, name: str) -> None:
    from scaletrain.cli.options import Parser

    p = sub.add_parser(name, help=HELP, description=HELP + " Each writes --json and --plot on request.",
                       allow_abbrev=False)
    benches = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=Parser)

    a = benches.add_parser("allreduce", prog="scaletrain bench allreduce", allow_abbrev=False,
                           help="time all_reduce, all_gather, reduce_scatter and broadcast; algbw and busbw",
                           description="Time collectives on N local ranks (torchrun), nccl-tests' algbw and "
                           "busbw per size, every result checked.")
    a.add_argument("--nproc", default="2", help="ranks on this machine [default: 2]")
    a.add_argument("--sizes", default="1KB..256MB",
                   help="bytes of the whole buffer: 1KB, 256MB, a list 1KB,1MB or a doubling range a..b "
                   "(1KB = 1024 bytes) [default: 1KB..256MB]")
    a.add_argument("--backend", default="auto", help="auto (nccl on GPUs, else gloo), gloo (CPU tensors) or nccl "
                   "[default: auto]")
    a.add_argument("--ops", default="all", help="all, or a list of all_reduce,all_gather,reduce_scatter,broadcast "
                   "[default: all]")
    a.add_argument("--iters", default="20", help="timed iterations per op and size [default: 20]")
    a.add_argument("--warmup", default="5", help="untimed (but checked) iterations first [default: 5]")
    _add_outputs(a)

    t = benches.add_parser("throughput", prog="scaletrain bench throughput", allow_abbrev=False,
                           help="training samples/s and peak memory per device and batch size",
                           description="Training throughput (samples/s, tokens/s for sequence models) and peak "
                           "memory of a recipe at world size 1, per device and batch size; one process per device. "
                           "Config overrides (--section.key=value) apply to every measurement.")
    t.add_argument("--recipe", default="digits", help=f"{', '.join(recipe_names())} or a TOML file [default: digits]")
    t.add_argument("--devices", default=None, help=f"comma-separated cpu, cuda, cuda:N [default: {_DEFAULT_DEVICES}; "
                   "cuda is skipped with a note where there is none]")
    t.add_argument("--batch-sizes", default="2,4,64", help="samples per step, comma-separated [default: 2,4,64]")
    t.add_argument("--steps", default="20", help="timed steps per repeat [default: 20]")
    t.add_argument("--warmup", default="5", help="untimed steps first, per batch size [default: 5]")
    t.add_argument("--repeats", default="3", help="timed repeats; the median is reported [default: 3]")
    _add_outputs(t)

    s = benches.add_parser("scaling", prog="scaletrain bench scaling", allow_abbrev=False, help="weak or strong scaling of a recipe over world sizes",
                           description="Run the recipe with 'scaletrain train --nproc N' for each N and report "
                           "throughput, speedup and efficiency. Config overrides (--section.key=value) are passed on.")
    s.add_argument("--recipe", default="gpt-stdlib",
                   help=f"{', '.join(recipe_names())} or a TOML file [default: gpt-stdlib]")
    s.add_argument("--nproc", default="1,2", help="world sizes, comma-separated [default: 1,2]")
    s.add_argument("--mode", default="weak", help="weak (per-rank batch fixed) or strong (global batch fixed) "
                   "[default: weak]")
    s.add_argument("--steps", default="40", help="timed steps per run [default: 40]")
    s.add_argument("--warmup", default="10", help="untimed steps first (also the log interval) [default: 10]")
    s.add_argument("--threads", default="1", help="intra-op threads per rank [default: 1]")
    s.add_argument("--runs-dir", default="", help="keep the runs' directories here [default: a temporary one]")
    _add_outputs(s)


def _add_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default="", help="write the results, with machine, versions, date and command")
    p.add_argument("--plot", default="", help="write a PNG plot")


def run(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    if args.bench is None:
        raise UserError("bench needs one of allreduce, throughput, scaling; fix: scaletrain bench allreduce --nproc 2")
    from scaletrain.bench.report import check_output_path

    check_output_path(args.json, "--json", ".json")
    check_output_path(args.plot, "--plot", ".png")
    return {"allreduce": _allreduce, "throughput": _throughput, "scaling": _scaling}[args.bench](args, leftovers, argv)


def _own_flags(bench: str) -> list[str]:
    flags = {"allreduce": ["--nproc", "--sizes", "--backend", "--ops", "--iters", "--warmup"],
             "throughput": ["--recipe", "--devices", "--batch-sizes", "--steps", "--warmup", "--repeats"],
             "scaling": ["--recipe", "--nproc", "--mode", "--steps", "--warmup", "--threads", "--runs-dir"]}
    return flags[bench] + ["--json", "--plot"]


def _unexpected(token: str, bench: str) -> UserError:
    close = difflib.get_close_matches(token.split("=")[0], _own_flags(bench), n=1)
    fix = f"did you mean {close[0]}?" if close else f"run 'scaletrain bench {bench} --help'"
    return UserError(f"bench {bench}: unrecognized argument {token!r}; fix: {fix}")


def config_overrides(leftovers: list[str], bench: str) -> dict[str, str]:
    """--section.key=value (or --section.key value) tokens, for the recipe's config; checked like train's."""
    from scaletrain.cli.options import check_types

    overrides: dict[str, str] = {}
    tokens = iter(leftovers)
    for token in tokens:
        key, eq, value = token[2:].partition("=")
        if not token.startswith("--") or "." not in key:
            raise _unexpected(token, bench)
        if not eq:
            value = next(tokens, "")
            if not value or value.startswith("--"):
                raise ConfigError(key, value, "a value", f"--{key}=VALUE", CLI)
        if key not in all_keys():
            raise unknown_key(key, value, CLI)
        overrides[key] = value
    check_types(overrides)
    return overrides


def _recipe(text: str) -> str:
    names = recipe_names()
    if text in names or (text.endswith(".toml") and Path(text).is_file()):
        return text
    close = difflib.get_close_matches(text, names, n=1)
    raise ConfigError("--recipe", text, f"a built-in recipe ({', '.join(names)}) or an existing TOML file",
                      f"--recipe {close[0] if close else names[0]}")


# ---------------------------------------------------------------------------------------------- allreduce


def _allreduce(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.bench.collectives import OPS, check_backend, check_sizes
    from scaletrain.cluster.forked import serial_launcher
    from scaletrain.cluster.torchrun import launch
    from scaletrain.config import DistConfig
    from scaletrain.env import under_launcher

    if leftovers:
        raise _unexpected(leftovers[0], "allreduce")
    backend = parse_choice(args.backend, "--backend", ("auto", "gloo", "nccl"))
    ops = parse_names(args.ops, "--ops", OPS)
    sizes = parse_sizes(args.sizes)
    iters = parse_int(args.iters, "--iters", minimum=1, example="20")
    warmup = parse_int(args.warmup, "--warmup", minimum=0, example="5")
    if under_launcher():  # a rank: torchrun (ours below, or the user's) decided the world
        return _allreduce_rank(args, backend, ops, sizes, iters, warmup)
    nproc = parse_int(args.nproc, "--nproc", minimum=1, example="2")
    check_sizes(sizes, nproc)
    check_backend(backend, nproc)
    serial_launcher()  # so that the workers can be forks of this process
    worker_argv = ["scaletrain", *argv[argv.index("bench"):]]
    return launch(DistConfig(nproc=nproc), worker_argv, module=True, run_id="scaletrain-bench-allreduce")


def _allreduce_rank(args: argparse.Namespace, backend: str, ops: list[str], sizes: list[int], iters: int,
                    warmup: int) -> int:
    from scaletrain import runtime
    from scaletrain.bench import collectives
    from scaletrain.bench.report import environment, header_line, print_table

    rt = runtime.init(collectives.dist_config(backend))
    try:
        collectives.check_sizes(sizes, rt.world_size)
        say = print if rt.is_main else (lambda _: None)
        env = environment()
        say(header_line(env))
        say(f"bench allreduce: {rt.world_size} ranks, {rt.backend} on {rt.device.type}, float32; median of {iters} "
            f"iterations after {warmup} warm-up; an iteration's time is its slowest rank's")
        results = collectives.run_all(ops, sizes, rt.rank, rt.world_size, rt.device, iters=iters, warmup=warmup,
                                      progress=say)
        if rt.is_main:
            columns, rows, sections = collectives.table(results)
            print_table(f"collectives on {rt.world_size} ranks ({rt.backend})", columns, rows, sections=sections,
                        caption="algbw = size / time; busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, "
                        "reduce_scatter), 1 (broadcast); GB = 1e9 bytes")
            data = {"bench": "allreduce", "environment": env, "world_size": rt.world_size, "backend": rt.backend,
                    "device": rt.device.type, "iters": iters, "warmup": warmup, "results": results}
            _write_outputs(args, data, lambda path: collectives.plot(
                results, path, f"busbw, {rt.world_size} ranks, {rt.backend} on {rt.device.type}"))
    except collectives.CollectiveMismatch as err:
        print(f"[rank {rt.rank}] scaletrain: bench failed: {err}", file=sys.stderr)
        return 1
    finally:
        runtime.close(rt)
    return 0


def _write_outputs(args: argparse.Namespace, data: dict[str, Any], plot: Any) -> None:
    from scaletrain.bench.report import write_json

    if args.json:
        print(f"wrote {write_json(args.json, data)}")
    if args.plot:
        print(f"wrote {plot(args.plot)}")


# --------------------------------------------------------------------------------------------- throughput


def _devices(text: str | None) -> list[str]:
    """The devices to measure; cuda is skipped with a note where there is none, unless asked for by name."""
    import torch

    explicit = text is not None
    names = [d.strip() for d in (text or _DEFAULT_DEVICES).split(",")]
    chosen: list[str] = []
    for name in names:
        if not (name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())):
            raise ConfigError("--devices", text, f"a comma-separated list of cpu, cuda, cuda:N ({name!r} is not one)",
                              "--devices cpu,cuda")
        if name.startswith("cuda"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(name[5:]) if ":" in name else 0
            if index >= count:
                if explicit:
                    have = f"{count} CUDA device(s)" if count else "no CUDA device"
                    raise ConfigError("--devices", text, f"devices this machine has (it has {have}; "
                                      "torch.cuda.is_available() is " f"{torch.cuda.is_available()})", "--devices cpu")
                print(f"note: {name} skipped: this machine has no CUDA device (--devices defaults to "
                      f"{_DEFAULT_DEVICES}; --devices cpu says so)")
                continue
        if name not in chosen:
            chosen.append(name)
    return chosen


def _throughput(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.bench import throughput
    from scaletrain.bench.report import environment, header_line, print_table

    overrides = config_overrides(leftovers, "throughput")
    throughput.check_overrides(overrides)
    recipe = _recipe(args.recipe)
    batch_sizes = sorted(parse_ints(args.batch_sizes, "--batch-sizes", minimum=1, example="2,4,64"))
    steps = parse_int(args.steps, "--steps", minimum=1, example="20")
    warmup = parse_int(args.warmup, "--warmup", minimum=0, example="5")
    repeats = parse_int(args.repeats, "--repeats", minimum=1, example="3")
    devices = _devices(args.devices)
    # The config's own mistakes (a bad override, fp16 on a CPU) are found here, before any process starts.
    for device in devices:
        throughput.bench_config(recipe, batch_sizes[0], device, warmup + repeats * steps, overrides)
    env = environment()
    print(header_line(env))
    print(f"bench throughput: {recipe} at world size 1 on {', '.join(devices)}; batch sizes "
          f"{', '.join(map(str, batch_sizes))}; median of {repeats} x {steps} steps after {warmup} warm-up")
    spec = {"recipe": recipe, "overrides": overrides, "batch_sizes": batch_sizes, "steps": steps,
            "warmup": warmup, "repeats": repeats}
    with tempfile.TemporaryDirectory(prefix="scaletrain-bench-") as work:
        try:
            results = throughput.run_devices(spec, devices, Path(work))
        except throughput.DeviceFailed as err:
            if err.code == 2:
                return 2  # its one-line error is already on stderr
            print(f"scaletrain: bench failed: {err}", file=sys.stderr)
            return 1
    columns, rows = throughput.table(results)
    print_table(f"training throughput, {recipe}", columns, rows,
                caption="world size 1; a step = load a batch, copy it to the device, forward, backward, optimizer")
    for r in results:
        if not all(row["peak_mem_reset"] for row in r["rows"]):
            print(f"note: {r['name']}'s peak memory could not be reset between batch sizes on this OS: each is the "
                  "process's peak so far")
    data = {"bench": "throughput", "environment": env, "recipe": recipe, "overrides": overrides, **spec,
            "devices": results}
    _write_outputs(args, data, lambda path: throughput.plot(results, path, f"training throughput, {recipe}"))
    return 0


# ------------------------------------------------------------------------------------------------ scaling


def _scaling(args: argparse.Namespace, leftovers: list[str], argv: list[str]) -> int:
    from scaletrain.bench import scaling
    from scaletrain.bench.report import environment, header_line, print_table, usable_cores
    from scaletrain.bench.runs import RunFailed
    from scaletrain.config import load

    overrides = config_overrides(leftovers, "scaling")
    recipe = _recipe(args.recipe)
    nprocs = sorted(parse_ints(args.nproc, "--nproc", minimum=1, example="1,2"))
    mode = parse_choice(args.mode, "--mode", ("weak", "strong"))
    steps = parse_int(args.steps, "--steps", minimum=1, example="40")
    warmup = parse_int(args.warmup, "--warmup", minimum=1, example="10")
    threads = parse_int(args.threads, "--threads", minimum=1, example="1")
    run_overrides = scaling.run_overrides(recipe, nprocs, mode, steps, warmup, overrides)
    cfg = load(recipe, cli_overrides=overrides)
    seq_len = cfg.data.seq_len if cfg.model.name == "gpt" else 0
    env = environment()
    print(header_line(env))
    print(f"bench scaling ({mode}): {recipe}, world sizes {', '.join(map(str, nprocs))}, {threads} thread(s) per "
          f"rank, {steps} timed steps after {warmup} warm-up")
    cores = usable_cores()
    crowded = [n for n in nprocs if n * threads > cores]
    if crowded:
        print(f"note: {', '.join(map(str, crowded))} rank(s) x {threads} thread(s) exceed the {cores} cores here: "
              "those ranks share cores, so their efficiency measures contention, not scaling")
    with tempfile.TemporaryDirectory(prefix="scaletrain-scaling-") as tmp:
        runs_dir = Path(args.runs_dir).resolve() if args.runs_dir else Path(tmp)
        try:
            results = scaling.measure(recipe, nprocs, run_overrides, threads=threads, runs_dir=runs_dir)
            if not args.runs_dir:
                for r in results:
                    r["run_dir"] = None  # removed with the temporary directory
        except RunFailed as err:
            print(f"scaletrain: bench failed: {err}", file=sys.stderr)
            return 1
    scaling.add_efficiency(results, mode)
    columns, rows = scaling.table(results, mode, seq_len)
    base = results[0]["nproc"]
    what = "per-rank throughput over 1 rank's" if mode == "weak" else "speedup / ranks, global batch fixed"
    print_table(f"{mode} scaling, {recipe}", columns, rows,
                caption=f"efficiency = {what}" + (f"; baseline {base} ranks" if base != 1 else "")
                + "; exposed comm = summary.json phase_frac['comm'], the median rank's share of step time")
    data = {"bench": "scaling", "environment": env, "recipe": recipe, "mode": mode, "overrides": overrides,
            "threads_per_rank": threads, "cores": cores, "steps": steps, "warmup": warmup, "results": results}
    _write_outputs(args, data, lambda path: scaling.plot(results, path, f"{mode} scaling, {recipe}", seq_len))
    return 0
