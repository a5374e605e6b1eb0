"""The tour of the docs: every shell command in README.md and docs/*.md, run as typed, in order, in one fresh
directory laid out like a checkout after `make demo`; a problem is an exit code the docs do not announce or,
where the docs show a command's output (a `console` block: `$ command` then its output), an output that is not
what the command prints. tests/cli/test_docs.py asserts there is none; other tests read what the documented
commands made (tests/conftest.py's docs_tour fixture).

What the tour may add, and never by editing the docs' text: short-run options appended to a command (SHORT
below: fewer steps, smaller batches and sizes), so the whole tour fits in the suite's budget; a command whose
output the docs show runs exactly as typed; a command whose effective text already ran is not run again.
How the docs tell the tour what to expect: an HTML comment (invisible on GitHub) just before a fenced block,

    <!-- doc-test: exit=2 -->                      every command of the block exits 2 (an error shown on purpose)
    <!-- doc-test: needs=cuda -->                  runs only where CUDA is (also: nodes = several machines,
                                                   slurm = sbatch on PATH, bench = the peers' extras installed,
                                                   netns = root and iproute2 for network namespaces)
    <!-- doc-test: file=my_run.toml -->            the block is a file the commands after it use: write it
    <!-- doc-test: slow -->                        one of the few expensive ones: they run together in
                                                   test_docs_slow_commands, scaled down (SCALED_DOWN)

Blocks fenced as bash, sh or console are commands; one logical line (continuations joined) is one command,
run with bash from the workspace, with the virtual environment's bin first on PATH as after
`. .venv/bin/activate` (what the README tells users to do). Under the suite, the `scaletrain` bash finds first
is tests/warm.py's client: the same console script, run in a fork of an interpreter that has imported torch
already, set up as a new one would start (SCALETRAIN_TEST_WARM=0: the venv's own, a new interpreter each).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import warm
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[1]
# In reading order: the README first (its `make demo` makes runs/digits, which docs/observe.md reads).
DOCS = ["README.md", "docs/observe.md", "docs/metrics.md", "docs/fsdp.md", "docs/plan.md", "docs/benchmarks.md",
        "docs/parallelism.md", "docs/labs.md", "docs/multinode.md"]
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 300

# Short runs: appended to a command that starts with the key (later options win in scaletrain's parser).
SHORT = {
    "scaletrain train ": "--train.max_steps=2 --log.every=1 --train.eval_batches=1 --data.batch_size=8 "
                         "--train.progress=false",
    "scaletrain verify-resume digits": "--steps 4 --at 2 --train.eval_batches=1 --data.batch_size=8 --train.progress=false",
    "scaletrain bench allreduce": "--sizes 1KB,64KB --iters 2 --warmup 1",
    "scaletrain bench throughput": "--steps 2 --repeats 1 --warmup 1",
    "scaletrain bench scaling": "--steps 2 --warmup 2",
    "python benchmarks/ddp_bucket.py": "--steps 4 --log-every 2 --rounds 1",
    "scaletrain launch --nproc 2 examples/gan.py": "--train.max_steps=4 --log.every=2",
    "python benchmarks/peers/run.py": "--steps 4 --log-every 2 --rounds 1",
}

# The `slow` commands (8 ranks, sweeps over world sizes) run scaled down to this 2-core machine: fewer ranks
# and sweep points (appended, so they win), and torchrun's own --nproc-per-node rewritten.
SCALED_DOWN = {
    "scaletrain train ": "--nproc 2",
    "scaletrain bench scaling": "--nproc 1,2",
    "python benchmarks/ddp_bucket.py": "--buckets 25",
    "scaletrain lab batch-size ": "--batches 32,128",  # the CNN: 2 batches x 2 settings, not 5 x 2
}
RANKS = (re.compile(r"--nproc-per-node \d+"), "--nproc-per-node 2")


@dataclass
class Command:
    doc: str
    line: int  # 1-based line of the command in its doc
    text: str  # as typed, continuations joined
    exit: int = 0
    needs: str = ""
    slow: bool = False
    output: list[str] | None = None  # console blocks: the lines shown after `$ command`
    files: dict[str, str] = field(default_factory=dict)  # files to write before running (file= blocks)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _markers(comment: str) -> dict[str, str]:
    m = re.fullmatch(r"\s*<!--\s*doc-test:(.*?)-->\s*", comment, flags=re.DOTALL)
    if not m:
        return {}
    found: dict[str, str] = {}
    for item in shlex.split(m.group(1)):
        key, _, value = item.partition("=")
        found[key] = value
    return found


def _logical_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, command) for each command of a shell block: continuations joined, comments and blank
    lines dropped (a trailing comment stays: bash ignores it)."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for offset, raw in enumerate(body.splitlines()):
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if not pending:
            start = first_line + offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append((start, pending + raw))
        pending = ""
    return out


def _console(body: str, first_line: int) -> list[tuple[int, str, list[str]]]:
    """(line, command, expected output lines) for each `$ command` of a console block (a command ending in a
    backslash goes on over the next lines)."""
    out: list[tuple[int, str, list[str]]] = []
    going_on = False
    for offset, raw in enumerate(body.splitlines()):
        if raw.startswith("$ ") or going_on:
            if going_on:
                line, text, shown = out.pop()
                out.append((line, text + " " + raw.strip(), shown))
            else:
                out.append((first_line + offset, raw[2:], []))
            going_on = raw.endswith("\\")
            if going_on:
                line, text, shown = out.pop()
                out.append((line, text[:-1].rstrip(), shown))
        elif out:
            out[-1][2].append(raw)
    return out


def doc_commands(doc: str) -> list[Command]:
    """The commands of one doc, in order, with what the doc says to expect of them."""
    text = (REPO / doc).read_text(encoding="utf-8")
    tokens = MarkdownIt().parse(text)
    commands: list[Command] = []
    files: dict[str, str] = {}
    marks: dict[str, str] = {}
    for token in tokens:
        if token.type == "html_block":
            marks = _markers(token.content)
            continue
        if token.type != "fence":
            marks = {} if token.type not in ("paragraph_open", "inline", "paragraph_close") else marks
            continue
        first = token.map[0] + 2 if token.map else 0  # the line after the opening fence
        lang = token.info.strip().split()[0] if token.info.strip() else ""
        if "file" in marks:
            files[marks["file"]] = token.content
        elif lang in ("bash", "sh", "shell"):
            for line, cmd in _logical_lines(token.content, first):
                commands.append(Command(doc, line, cmd, int(marks.get("exit", 0)), marks.get("needs", ""),
                                        "slow" in marks, files=dict(files)))
        elif lang == "console":
            for line, cmd, output in _console(token.content, first):
                commands.append(Command(doc, line, cmd, int(marks.get("exit", 0)), marks.get("needs", ""),
                                        "slow" in marks, output=output, files=dict(files)))
        marks = {}
    return commands


ALL = [c for doc in DOCS for c in doc_commands(doc)]


# What `make demo` runs (the Makefile's demo recipe), for a suite that runs outside the venv `make` made.
DEMO = "scaletrain train digits --nproc 2"


def _missing(cmd: Command) -> str:
    """Why this run cannot run ``cmd`` ('' = it can)."""
    if cmd.text.startswith("make test"):
        return "the suite that runs this test"
    needs = cmd.needs
    if not needs:
        return ""
    if needs == "cuda":
        import torch

        return "" if torch.cuda.is_available() else "needs CUDA"
    if needs == "slurm":
        return "" if shutil.which("sbatch") else "needs Slurm (sbatch)"
    if needs == "bench":
        import importlib.util

        have = all(importlib.util.find_spec(m) for m in ("lightning", "accelerate"))
        return "" if have else "needs the peers' extras (pip install -e '.[bench]')"
    if needs == "nodes":
        return "needs several machines"
    if needs == "netns":
        from scaletrain.cluster.netns import unavailable

        why = unavailable(shaped=True)
        return f"needs network namespaces: {why}" if why else ""
    return f"unknown need {needs!r}"


def _shortened(cmd: Command) -> str:
    """The command with SHORT's options appended (and, for a slow one, SCALED_DOWN's), before a trailing
    comment, which is dropped then. A command whose output the docs show runs exactly as typed."""
    if cmd.output is not None:
        return cmd.text
    if cmd.text.startswith("make demo") and not (REPO / ".venv" / ".installed").is_file():
        return DEMO  # no venv made by `make` (the suite runs outside it): its recipe, as `make` would run it
    code = cmd.text.partition(" #")[0].rstrip()
    extra = [more for prefix, more in SHORT.items() if code.startswith(prefix) and more]
    if cmd.slow:
        code = RANKS[0].sub(RANKS[1], code)
        extra += [more for prefix, more in SCALED_DOWN.items() if code.startswith(prefix)]
    return " ".join([code, *extra]) if extra or cmd.slow else cmd.text


def _workspace(root: Path) -> Path:
    """A directory that looks like the checkout after `make demo` (its code and venv linked, its writes its
    own), so the docs' relative paths work and nothing lands in the real checkout."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "benchmarks", "src", "Makefile", "pyproject.toml", "README.md", "docs", ".venv"):
        if (REPO / name).exists() and not (root / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"  # as after `. .venv/bin/activate`
    socket_path = env.get(warm.SOCKET_ENV, "0")
    if socket_path != "0":  # `scaletrain` forked from the suite's warm interpreter (tests/warm.py), as it would start
        env["PATH"] = f"{warm.commands_dir(socket_path)}{os.pathsep}{env['PATH']}"
    env.update(PYTHONUNBUFFERED="1", COLUMNS="80", TERM="dumb")
    return env


def _run(cmd: Command, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    for name, content in cmd.files.items():
        if not (cwd / name).exists():
            (cwd / name).write_text(content, encoding="utf-8")
    started = time.perf_counter()
    proc = subprocess.run(["bash", "-c", _shortened(cmd)], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
    return proc, time.perf_counter() - started


def _check(cmd: Command, proc: subprocess.CompletedProcess[str]) -> str:
    """'' when the command did what its doc says, else why not."""
    tail = f"\n--- stdout\n{proc.stdout[-2500:]}\n--- stderr\n{proc.stderr[-2500:]}"
    if proc.returncode != cmd.exit:
        return f"{cmd.where}: `{cmd.text}` exited {proc.returncode}, the doc expects {cmd.exit}{tail}"
    if cmd.output is not None:
        got = (proc.stdout + proc.stderr).rstrip("\n").splitlines()
        want = list(cmd.output)
        while want and not want[-1].strip():
            want.pop()
        if got != want:
            return f"{cmd.where}: `{cmd.text}` printed\n" + "\n".join(got) + "\n--- the doc shows\n" + "\n".join(want)
    return ""


@dataclass
class Ran:
    cmd: Command
    typed: str  # what ran: the command with the test's short-run options
    proc: subprocess.CompletedProcess[str] | None  # None: not runnable here, or the same as an earlier one
    seconds: float
    problem: str  # '' when it did what its doc says
    note: str = ""  # why it did not run

    @property
    def run_dir(self) -> Path | None:
        """The run directory a training command wrote (the header's "run dir ..."), if any."""
        found = re.search(r"\| run dir (\S+)", self.proc.stdout) if self.proc else None
        return Path(found.group(1)) if found else None


@dataclass
class Tour:
    workspace: Path
    ran: list[Ran] = field(default_factory=list)

    def find(self, text: str) -> Ran:
        """The first command whose text (as typed in the docs) starts with ``text``."""
        return next(r for r in self.ran if r.cmd.text.startswith(text))

    def problems(self) -> list[str]:
        return [r.problem for r in self.ran if r.problem]

    def summary(self) -> str:
        done = [r for r in self.ran if r.proc is not None]
        notes = "; ".join(f"{r.cmd.where} ({r.note})" for r in self.ran if r.note)
        slowest = ", ".join(f"{r.cmd.where} {r.seconds:.1f} s" for r in sorted(done, key=lambda r: -r.seconds)[:8])
        return f"docs commands: {len(done)} ran, {len(self.ran) - len(done)} did not: {notes}\nslowest: {slowest}"


def workspace(root: Path) -> Path:
    return _workspace(root)


def tour(cmds: list[Command], cwd: Path, *, earlier: Tour | None = None) -> Tour:
    """Run ``cmds`` in order in ``cwd``. A command whose effective text (short-run options included) already
    ran in this workspace is not run twice: it has been shown to work as typed. Two commands that differ only
    in their trailing comment (the README's overview and a later section both show `scaletrain doctor`) are
    the same command to bash."""
    result = Tour(cwd)

    def code(typed: str) -> str:
        return typed.partition(" #")[0].rstrip()

    seen = {code(r.typed): r.cmd.where for r in (earlier.ran if earlier else []) if r.proc is not None}
    for cmd in cmds:
        typed = _shortened(cmd)
        why = _missing(cmd) or (f"the same command ran as {seen[code(typed)]}" if code(typed) in seen else "")
        if why:
            result.ran.append(Ran(cmd, typed, None, 0.0, "", why))
            continue
        proc, seconds = _run(cmd, cwd)
        seen[code(typed)] = cmd.where
        result.ran.append(Ran(cmd, typed, proc, seconds, _check(cmd, proc)))
    return result
