"""The report's table: a run's key numbers, one column per run. The same rows go to the console (rich) and
into report.html, from summary.json where the run finished and from metrics.jsonl where it did not."""

from __future__ import annotations

import math
from typing import Any

from scaletrain.observe.report.load import EVAL_OWN, Run

NONE = "—"  # a number this run did not record


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _last(records: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(records) if key in r), None)


def _fmt(value: Any, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    v = _num(value)
    return NONE if v is None else f"{v * scale:{fmt}}{suffix}"


def stragglers_of(run: Run) -> list[dict[str, Any]] | None:
    """summary.json's straggler list; for an unfinished run, the metrics' per-interval flags grouped by rank
    and phase. None when the run recorded neither (phase timing predates it)."""
    if run.summary is not None and isinstance(run.summary.get("stragglers"), list):
        return [s for s in run.summary["stragglers"] if isinstance(s, dict)]
    if not any(r.get("phase_s") for r in run.train):
        return None
    grouped: dict[tuple[Any, Any], dict[str, Any]] = {}
    for r in run.train:
        s = r.get("straggler")
        if isinstance(s, dict):
            entry = grouped.setdefault((s.get("rank"), s.get("phase")), {**s, "intervals": 0})
            entry["intervals"] += 1
    return list(grouped.values())


def _straggler_text(s: dict[str, Any]) -> str:
    host = f" ({s['host']})" if s.get("host") else ""
    slower = _fmt(s.get("slower_by_s"), ".3f", suffix=" s")
    frac = _fmt(s.get("slower_by_frac"), "+.0f", 100, "%")
    times = f", {s['intervals']} interval{'s' * (s['intervals'] != 1)}" if isinstance(s.get("intervals"), int) else ""
    return f"rank {s.get('rank')}{host}: {s.get('phase')} slower by {slower} ({frac}){times}"


def _phase_text(frac: Any) -> str:
    if not isinstance(frac, dict):
        return NONE
    shares = sorted(((k, v) for k, v in frac.items() if _num(v) is not None and k not in ("step", "pre_comm")),
                    key=lambda kv: -kv[1])
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares) or NONE


def _window(s: dict[str, Any]) -> str:
    """Which steps the throughput and MFU are measured over (summary.json's steady_state)."""
    if "steady_state" not in s:
        return NONE  # a summary from before steady states were told apart: the whole run's average
    steady = s["steady_state"]
    if isinstance(steady, dict) and _num(steady.get("first_step")) is not None:
        return f"steady state, steps {steady['first_step']}-{steady.get('last_step')}"
    return "the whole run (no log interval after the warm-up)"


def _goodput_text(goodput: Any) -> str:
    from scaletrain.observe.goodput import describe

    try:
        return describe(goodput)
    except (KeyError, TypeError, ValueError):  # absent (an older summary) or not this shape
        return NONE


def _column(run: Run) -> dict[str, str]:
    s = run.summary or {}
    steps = s.get("steps", _last(run.train, "step"))
    epochs = _fmt(s.get("epochs"), ".2f", suffix=" epochs")
    world = s.get("world_size", run.world_size)
    where = ", ".join(str(s[k]) for k in ("backend", "device") if k in s)
    evals = s.get("eval") if isinstance(s.get("eval"), dict) else \
        {k[5:]: v for k, v in (run.eval[-1] if run.eval else {}).items() if k.startswith("eval_")}
    throughput = _fmt(s.get("samples_per_s", _last(run.train, "samples_per_s")), ",.1f", suffix=" samples/s")
    if world and _num(s.get("samples_per_s", _last(run.train, "samples_per_s"))) is not None:
        per_rank = float(s.get("samples_per_s", _last(run.train, "samples_per_s"))) / world
        throughput += f" ({per_rank:,.1f} per rank)"
    verdict = s.get("bottleneck") if isinstance(s.get("bottleneck"), dict) else {}
    stragglers = stragglers_of(run)
    col = {
        "run dir": str(run.path),
        "status": _status(run),
        "steps": _fmt(steps, ",.0f") + (f" ({epochs})" if epochs != NONE else ""),
        "world size": NONE if world is None else f"{world}" + (f" ({where})" if where else ""),
        "global batch": _fmt(s.get("global_batch"), ",.0f"),
        "wall time": _fmt(s.get("wall_s"), ",.1f", suffix=" s"),
        "throughput": throughput,
        "tokens/s": _fmt(s.get("tokens_per_s", _last(run.train, "tokens_per_s")), ",.0f"),
        "achieved FLOP/s": _fmt(s.get("flops_per_s", _last(run.train, "flops_per_s")), ".3g"),
        "MFU": _fmt(s.get("mfu", _last(run.train, "mfu")), ".1f", 100, "%"),
        "measured over": _window(s),
        "time spent on": _goodput_text(s.get("goodput")),
        "train loss": _fmt(s.get("train_loss", _last(run.train, "loss")), ".4f"),
    }
    for key in ("loss", "accuracy"):
        if key in evals:
            col[f"eval {key}"] = _fmt(evals[key], ".2f", 100, "%") if key == "accuracy" else _fmt(evals[key], ".4f")
    for key, value in evals.items():  # fit()'s metrics=
        if key not in EVAL_OWN:
            col[f"eval {key}"] = _fmt(value, ".4f")
    stop = s.get("early_stop")
    if isinstance(stop, dict):
        col["early stop"] = f"at step {_fmt(stop.get('step'), ',.0f')}: best eval {stop.get('monitor', 'loss')} " \
                            f"{_fmt(stop.get('best'), '.4f')} at step {_fmt(stop.get('best_step'), ',.0f')}"
    best = s.get("best_checkpoint")
    if isinstance(best, dict):
        col["best checkpoint"] = f"step {_fmt(best.get('step'), ',.0f')}" + \
            (", its weights loaded into the model" if best.get("loaded") else "")
    mem = s.get("peak_mem_bytes", (_last(run.train, "mem") or {}).get("peak_bytes"))
    col["peak memory / rank"] = _fmt(mem, ",.0f", 1 / 2**20, " MiB")
    col["phase shares"] = _phase_text(s.get("phase_frac"))
    col["bottleneck"] = f"{verdict['verdict']}: {verdict.get('evidence', '')}".rstrip(": ") \
        if verdict.get("verdict") else NONE
    col["fix"] = str(verdict["fix"]) if verdict.get("fix") else NONE
    col["stragglers"] = NONE if stragglers is None else \
        "; ".join(_straggler_text(x) for x in stragglers) if stragglers else "none flagged"
    noise = s.get("grad_noise_scale")
    if isinstance(noise, dict) and noise.get("reading"):
        col["gradient noise scale"] = str(noise["reading"])
    if "skipped_steps" in s or _last(run.train, "skipped_steps") is not None:
        col["skipped steps"] = str(s.get("skipped_steps", _last(run.train, "skipped_steps")))
    return col


def summary_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """[(row name, [value for each run])]; a row no run has a value for is left out."""
    columns = [_column(r) for r in runs]
    names: list[str] = []
    for col in columns:
        names += [k for k in col if k not in names]
    rows = [(n, [col.get(n, NONE) for col in columns]) for n in names]
    return [(n, values) for n, values in rows if any(v != NONE for v in values)]


def _status(run: Run) -> str:
    if run.summary is not None:
        return "finished"
    ended = run.ended
    if ended is None:
        return "no summary.json (unfinished, running, or killed)"
    if ended["kind"] == "stopped":
        return f"stopped at step {ended.get('step')} ({ended.get('reason')}): the same command resumes it"
    return f"failed at step {ended.get('step')}: {ended.get('error')}"
