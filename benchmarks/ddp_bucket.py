"""DDP step time on CPU/Gloo for several gradient bucket sizes: is another default than 25 MB faster here?

    python benchmarks/ddp_bucket.py --nproc 2 --buckets 1,5,25,100 --steps 60 --rounds 5 [--json buckets.json]
    python benchmarks/ddp_bucket.py --buckets 0.05 --overlap both ...   # what overlapping backward buys

Each run is `scaletrain train gpt-stdlib --nproc N --parallel.bucket_mb=B` (one intra-op thread per rank),
its step time read from metrics.jsonl: the median log interval, the first (warm-up) excluded. Rounds are
interleaved (B1 B2 B3 B4 B1 B2 ...) so that drift in the machine's load hits every bucket size alike; a bucket
size's result is the median over rounds. With ``--overlap both`` every bucket size runs twice per round, with
DDP's overlap and with ``--parallel.overlap=false`` (every all-reduce held to the end of backward), and the
table adds the exposed communication: the median per-step ``comm`` phase over every rank and kept interval
(what backward did not hide). Extra --section.key=value arguments go to every run (for instance
--model.n_embd=256 for a model whose gradients span several buckets).

How to read it: DDP puts gradients into buckets of about bucket_mb in reverse order of the parameters, and
all-reduces a bucket as soon as backward has filled it, overlapping communication with the rest of backward.
gpt-stdlib's gradients are small (printed below): every bucket size at least that large gives one bucket
after DDP's first, 1 MB one (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), so those sizes should tie.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from scaletrain.bench.report import environment, header_line, print_table, write_json
from scaletrain.bench.runs import RunFailed, run_training
from scaletrain.config import load
from scaletrain.observe.goodput import steady_state


def parse_args() -> tuple[argparse.Namespace, dict[str, str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks [default: 2]")
    p.add_argument("--buckets", default="1,5,25,100", help="bucket sizes in MB [default: 1,5,25,100]")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run [default: 60]")
    p.add_argument("--log-every", type=int, default=10, help="steps per timed interval [default: 10]")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds [default: 5]")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank [default: 1]")
    p.add_argument("--recipe", default="gpt-stdlib", help="[default: gpt-stdlib]")
    p.add_argument("--overlap", choices=["true", "false", "both"], default="true",
                   help="all-reduce each bucket during backward (true, DDP's way), at its end (false), or "
                   "both side by side [default: true]")
    p.add_argument("--json", default="", help="write the results here")
    args, rest = p.parse_known_args()
    overrides = {}
    for token in rest:
        key, eq, value = token.removeprefix("--").partition("=")
        if not token.startswith("--") or not eq:
            p.error(f"unexpected {token!r}: extra options are --section.key=value")
        overrides[key] = value
    args.buckets = [float(b) for b in args.buckets.split(",")]
    args.overlap = ["true", "false"] if args.overlap == "both" else [args.overlap]
    if args.steps < 2 * args.log_every:
        p.error(f"--steps must be at least 2 x --log-every = {2 * args.log_every}")
    return args, overrides


def gradient_bytes(recipe: str, overrides: dict[str, str]) -> int:
    """Bytes of one full set of fp32 gradients for the recipe's model (what DDP all-reduces every step)."""
    from scaletrain.data import build_splits
    from scaletrain.models import build_model

    cfg = load(recipe, cli_overrides=overrides)
    splits = build_splits(cfg.data, cfg.model)
    model = build_model(cfg.model, splits.task, splits.info)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def exposed_comm(records: list[dict]) -> float:
    """Median per-step communication that backward did not hide: the ``comm`` phase of every rank over the log
    intervals after the first (warm-up)."""
    return statistics.median(x for r in records[1:] for x in r["phase_s"]["comm"])


def main() -> int:
    args, extra = parse_args()
    env = environment([sys.executable, *sys.argv])
    grads = gradient_bytes(args.recipe, extra)
    print(header_line(env))
    print(f"ddp buckets: {args.recipe}, {args.nproc} ranks (gloo, cpu), {args.threads} thread(s) per rank, "
          f"gradients {grads / 2**20:.2f} MiB per step; buckets {', '.join(f'{b:g}' for b in args.buckets)} MB; "
          f"{args.rounds} interleaved rounds")
    runs = [(b, o) for b in args.buckets for o in args.overlap]
    times: dict[tuple[float, str], list[float]] = {r: [] for r in runs}
    comms: dict[tuple[float, str], list[float]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory(prefix="scaletrain-buckets-") as tmp:
        for round_ in range(args.rounds):
            for b, o in runs:
                overrides = {**extra, "parallel.bucket_mb": b, "parallel.overlap": o,
                             "train.max_steps": args.steps, "log.every": args.log_every,
                             "train.eval_batches": 1, "train.progress": "false", "dist.device": "cpu"}
                try:
                    run = run_training(args.recipe, args.nproc, Path(tmp) / f"b{b:g}-{o}-{round_}", overrides,
                                       threads=args.threads)
                except RunFailed as err:
                    print(f"ddp_bucket: bucket {b:g} MB, overlap {o} failed: {err}", file=sys.stderr)
                    return 1
                times[b, o].append(steady_state(run.records)["step_time_s"])
                comms[b, o].append(exposed_comm(run.records))
                print(f"  round {round_ + 1}/{args.rounds} bucket {b:>6g} MB overlap {o:<5}: "
                      f"{times[b, o][-1] * 1e3:8.2f} ms/step, comm exposed {comms[b, o][-1] * 1e3:7.2f} ms")
    medians = {r: statistics.median(t) for r, t in times.items()}
    comm = {r: statistics.median(c) for r, c in comms.items()}
    ref = medians.get((25.0, args.overlap[0]))
    rows = [[f"{b:g}", o, f"{m * 1e3:.2f}", f"{min(times[b, o]) * 1e3:.2f}-{max(times[b, o]) * 1e3:.2f}",
             f"{comm[b, o] * 1e3:.2f}", f"{m / ref:.3f}" if ref else "-", str(max(1, -(-grads // int(b * 2**20))))]
            for (b, o), m in medians.items()]
    print_table(f"DDP step time by bucket size, {args.nproc} ranks",
                ["bucket MB", "overlap", "ms/step (median)", "rounds' range", "comm exposed ms", "vs 25 MB",
                 "buckets (approx.)"], rows,
                caption="buckets (approx.) = gradient bytes / bucket size, ignoring DDP's 1 MB first bucket; a "
                "difference smaller than the rounds' range is not a difference")
    if args.json:
        data = {"bench": "ddp_bucket", "environment": env, "recipe": args.recipe, "overrides": extra,
                "nproc": args.nproc, "threads_per_rank": args.threads, "gradient_bytes": grads,
                "steps": args.steps, "log_every": args.log_every, "rounds": args.rounds,
                "overlap": args.overlap,
                "step_time_s": {f"{b:g}/{o}": m for (b, o), m in medians.items()},
                "round_step_time_s": {f"{b:g}/{o}": t for (b, o), t in times.items()},
                "comm_exposed_s": {f"{b:g}/{o}": c for (b, o), c in comm.items()},
                "round_comm_exposed_s": {f"{b:g}/{o}": c for (b, o), c in comms.items()}}
        print(f"wrote {write_json(args.json, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
