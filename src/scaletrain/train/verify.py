"""verify-resume: does a run interrupted at step k and resumed from its checkpoint equal one that never stopped?

Three real runs of the user's own job, each a separate `scaletrain train` process tree with per-step traces
(train/trace.py): A runs straight to step N; B runs to step k and stops exactly as a preempted job does
(checkpoint, exit 0); C is started fresh, resumes B's checkpoint, and runs to N. All three stop through the
same mechanism, so the LR schedule is the configured one, not a shortened copy.

The comparison, per rank: B's steps 1..k against A's (if they differ, the job is not reproducible even
without an interruption, and resuming cannot be judged); C's state right after loading against A's state
after step k (a part that differs there was not restored); then C's steps k+1..N against A's. The first
difference names the step, the rank and the parts: weights, optimizer, RNG, data order, batch values, LR
schedule.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

# Trace fields grouped into the parts a user can act on, in the order a cause shows up.
PARTS: dict[str, tuple[str, ...]] = {
    "data order": ("indices", "loader"),
    "batch values": ("data",),  # the same samples (indices) drawn otherwise: augmented from another RNG state
    "LR schedule": ("lr", "scheduler"),
    "RNG": ("rng",),
    "weights": ("weights",),
    "optimizer": ("optimizer",),
    "loss": ("loss",),
}
STATE_FIELDS = ("weights", "optimizer", "rng", "scheduler", "loader")


@dataclass
class Verdict:
    identical: bool
    steps: int
    at: int
    ranks: int
    phase: str = ""  # "before the interruption" | "at resume" | "after resume"
    step: int = 0  # first differing step
    rank: int = 0
    parts: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)
    unread: bool = False  # no batch came through st.loader: the data order was neither traced nor restored
    held: list[str] = field(default_factory=list)  # models holding unused gradients then, in the straight run only

    def text(self) -> str:
        if self.identical:
            return (f"identical: interrupted after step {self.at} and resumed, the run matches the uninterrupted "
                    f"one bit for bit at every one of {self.steps} steps on all {self.ranks} rank(s): loss, "
                    "weights, optimizer, RNG, data order and LR schedule")
        differ = f"{', '.join(self.parts)} differ{'s' if len(self.parts) == 1 else ''}"
        if self.phase == "before the interruption" and self.step == 0:
            said = (f"diverged before the first step on rank {self.rank}: {differ} from run to run, so "
                    "resuming cannot be judged")
            if self.parts == ["weights"]:
                said += ("; the likely cause: the model is built before the run seeds the RNG, from an unseeded "
                         "one; fix: torch.manual_seed(0) before building it, or build it once the run started "
                         "(fit() given the model's class builds it so, a session's loop after "
                         "scaletrain.session() opened)")
            return said
        where = {"at resume": f"right after loading the checkpoint of step {self.step}",
                 "before the interruption": f"at step {self.step}, before any interruption (the job is not "
                                            "reproducible run to run, so resuming cannot be judged; on a GPU, "
                                            "--train.deterministic=true makes the kernels repeatable)",
                 "after resume": f"at step {self.step}"}[self.phase]
        said = f"diverged {where} on rank {self.rank}: {differ}"
        if "batch values" in self.parts and "data order" not in self.parts and not self.unread:
            said += ("; the same samples came out otherwise: a data set or collate_fn drawing from a generator "
                     "of its own (random augmentation), which no checkpoint holds; fix: draw from torch's, "
                     "Python's or NumPy's global RNG, which scaletrain restores (and seeds per sample in "
                     "DataLoader workers)")
        if self.held and self.phase == "after resume" and self.step == self.at + 1:
            models = " and ".join(self.held)
            said += (f"; the likely cause: {models} held gradients no optimizer step used as step {self.step} began "
                     f"in the uninterrupted run only, left by a backward after {'its' if len(self.held) == 1 else 'their'} "
                     "last zero_grad() (a generator's loss reaching the discriminator), which no checkpoint holds and "
                     "which the next optimizer step adds in unless zeroed first; fix: zero the gradients before each "
                     "backward (opt.zero_grad() first), or after the last backward reaching the model")
            return said
        own = self.phase == "after resume" and not {"data order", "batch values", "LR schedule", "RNG"} & set(self.parts)
        if own and not self.unread and self.step == self.at + 1:  # all restored alike, yet the next step differs
            said += ("; the likely cause: state of the loop's own that no checkpoint holds, which it used anew after "
                     "the resume (a random generator kept deeper than one attribute of its variables, a count of "
                     "calls); fix: give it to st.track() (anything with state_dict() and load_state_dict(), or a "
                     "generator)")
        if self.unread and self.phase == "after resume":
            said += ("; the likely cause: this loop reads no st.loader, so its data were neither traced nor restored (a "
                     "DataLoader of its own starts its epoch again after a resume); fix: read them through "
                     "st.loader(dataset)")
        return said


def _parts(fields: list[str]) -> list[str]:
    return [part for part, names in PARTS.items() if any(f in fields for f in names)] or fields


def _diff(a: dict[str, Any], b: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in a and a.get(n) != b.get(n)]


def read_trace(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> trace records, in file order."""
    folder = run_dir / "trace"
    traces: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        traces[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return traces


def compare(straight: dict[int, list[dict[str, Any]]], first: dict[int, list[dict[str, Any]]],
            resumed: dict[int, list[dict[str, Any]]], steps: int, at: int) -> Verdict:
    """Compare the three runs' traces (see the module docstring)."""
    step_fields = ("indices", "data", "lr", "rng", "weights", "optimizer", "scheduler", "loader", "loss")
    verdict = Verdict(True, steps, at, len(straight))
    verdict.unread = not any(r.get("indices") for records in straight.values() for r in records)
    found: list[tuple[int, int, int, list[str]]] = []  # (phase order, step, rank, fields)
    for rank in sorted(straight):
        a = {r["step"]: r for r in straight[rank] if "event" not in r}
        b = {r["step"]: r for r in first.get(rank, []) if "event" not in r}
        loads = [r for r in resumed.get(rank, []) if r.get("event") == "resume"]
        starts = [next((r for r in run.get(rank, []) if r.get("event") == "start"), None)
                  for run in (straight, first)]
        if None not in starts and (fields := _diff(*starts, STATE_FIELDS)):
            found.append((0, 0, rank, fields))  # apart before their first step: its initial state
        c = {r["step"]: r for r in resumed.get(rank, []) if "event" not in r}
        for s in range(1, at + 1):
            fields = _diff(a.get(s, {}), b.get(s, {"missing": True}), step_fields) if s in a else []
            if fields:
                found.append((0, s, rank, fields))
                break
        if loads and at in a:
            fields = _diff(a[at], loads[0], STATE_FIELDS)
            if fields:
                found.append((1, at, rank, fields))
        elif not loads:
            found.append((1, at, rank, ["resume"]))
        for s in range(at + 1, steps + 1):
            if s not in a:
                continue
            fields = _diff(a[s], c.get(s, {k: None for k in step_fields}), step_fields)
            if fields:
                found.append((2, s, rank, fields))
                break
    if found:
        order, step, rank, fields = min(found, key=lambda f: (f[0], f[1], f[2]))
        verdict.identical = False
        verdict.phase = ("before the interruption", "at resume", "after resume")[order]
        verdict.step, verdict.rank, verdict.fields = step, rank, fields
        verdict.parts = _parts(fields)
        if order == 2:  # the gradients a step began with, where only the uninterrupted run held them: a cause
            held = [next((r.get("held") or [] for r in run.get(rank, []) if r.get("step") == step and "event" not in r),
                         []) for run in (straight, resumed)]
            verdict.held = held[0] if held[0] != held[1] else []
    return verdict


def run_train(config: str, args: list[str], run_dir: Path, env: dict[str, str]) -> None:
    """One `scaletrain train` process tree; a failure is a UserError carrying its last lines."""
    _run([sys.executable, "-m", "scaletrain", "train", config, *args, f"--run.dir={run_dir}", "--debug.trace=true",
          "--train.progress=false"], run_dir, env, f"scaletrain train {config} ...")


def run_script(script: str, args: list[str], run_dir: Path, env: dict[str, str], world: int) -> None:
    """A script whose loop runs in a scaletrain.session or fit() reading the command line, as `python SCRIPT` or, for several ranks,
    `scaletrain launch --nproc N SCRIPT`; a failure is a UserError carrying its last lines, and so is a run that
    traced no step (no session took the command line: comparing nothing would have said "identical")."""
    launcher = ["python"] if world == 1 else ["scaletrain", "launch", "--nproc", str(world)]
    own = [*args, f"--run.dir={run_dir}", "--debug.trace=true"]
    shown = shlex.join([*launcher, script, *own])
    _run([sys.executable, *(["-m", "scaletrain", *launcher[1:]] if world > 1 else []), script, *own], run_dir, env,
         shown)
    if not read_trace(run_dir):
        raise UserError(f"verify-resume: `{shown}` ran to its end but traced no step in {run_dir}: its loop runs in "
                        "no scaletrain.session or fit(), or in one given an argv that leaves out the command line's; fix: "
                        "scaletrain.session() or fit() without argv (or argv=sys.argv[1:]) (the script's own "
                        "arguments go after --)")


def _run(cmd: list[str], run_dir: Path, env: dict[str, str], shown: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        said = proc.stderr.strip() or proc.stdout.strip()
        tail = " | ".join(said.splitlines()[-3:]) if said else "it printed nothing"
        raise UserError(f"verify-resume: the run in {run_dir} failed (exit {proc.returncode}): {tail}; fix: make "
                        f"`{shown}` work first")
