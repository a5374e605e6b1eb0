"""Per-rank phase times of every step, without a host-device sync per step.

Phases (docs/metrics.md): ``data`` (waiting for the loader), ``h2d`` (copying the batch to the device),
``compute`` (forward and backward, less the exposed communication), ``comm`` (exposed communication: from
the moment the rank's last gradient bucket was ready to be all-reduced until backward returned, which is
the all-reduce that overlap did not hide), ``optim`` (clipping, the non-finite guard, the optimizer and the
schedule), ``ckpt`` (the loop blocked by a checkpoint), ``step`` (all of it) and ``pre_comm`` (from the step's
start until the rank's last bucket was ready: the "compute before collective" that tells a slow rank from the
ranks that wait for it).

On a CPU every mark is a ``perf_counter`` read. On a GPU the marks are CUDA events recorded on the compute
stream and read back only when the interval is collected (at log steps), so timing adds no sync; the data
wait is a host time on both. Where the host waits for those events at a log step is a measurement too:
``lead_s``, how long the GPU still had queued work after the host had enqueued the interval's last step. A
GPU that keeps the host waiting has work queued (a step or more); one that waits for Python has next to
none, and that is the host-bound verdict on a GPU (CUDA events cannot see it: they time the GPU's idle
gaps between kernels as compute). Exposed communication is measured for DDP (through a comm hook that notes when
each bucket is handed to the all-reduce); under FSDP its reduce-scatters are counted in ``compute``, and
``pre_comm`` ends where the root's forward starts its first all-gather (attach_forward_mark). Tensor
parallelism is the same: its all-reduces and all-gathers wait inside forward and backward, so ``pre_comm``
ends where forward starts; within a TP group a data or copy straggler is named by these phases, a compute one by
when it issued the group's collectives (observe/arrivals.py).

A pipeline stage (parallel.pp > 1) spends its step partly computing its micro-batches and partly waiting for the
other stages and its replicas (the bubble, point-to-point, the replicas' all-reduce), interleaved: the runner
times its own chunks (its busy time), so ``compute`` is that and ``comm`` the rest of the pipeline's step, and
``pre_comm`` is the step until the pipeline returned less the waiting: the time the rank spent on its own,
which names a slow stage replica as it names a slow DDP rank.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import torch

PHASES = ("data", "h2d", "compute", "comm", "optim", "ckpt", "step", "pre_comm")


class StepTimer:
    """Marks inside train_step; sums per phase over the current log interval."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)  # seconds, summed over the interval's steps
        self.steps = 0
        self._pending: list[list[tuple[str, Any]]] = []  # GPU: per step, (phase, event) marks to resolve
        self._marks: list[tuple[str, Any]] = []
        self._bucket: Any = None  # the last bucket handed to the all-reduce in this backward
        self._start: Any = None
        self._entered: Any = None  # FSDP: when the step's first collective began
        self.buckets = 0  # buckets handed to the all-reduce, over the whole run
        self.lead_s = 0.0  # GPU: at the last collect, the seconds the host waited for the queued work
        self.timeline: Any = None  # observe/timeline.py Timeline (log.trace): each step's spans kept too
        self._host0 = 0.0  # the host's clock at the step's start (anchors a GPU's event times)
        self._host_spans: list[tuple[str, float, float]] = []  # this step's host-timed phases (the data wait)
        self._pending_steps: list[tuple[int, float, list[tuple[str, float, float]]]] = []  # GPU: per pending step

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # -- marks ------------------------------------------------------------------------------------------

    def start(self, *, waited: float = 0.0) -> None:
        """A step begins now, or on a CPU ``waited`` seconds ago: a loop's first step, whose batch the loop fetched
        before the step could start the clock (its wait is in the step, as every later step's is)."""
        self._marks = []
        self._host0 = time.perf_counter()
        self._host_spans = []
        self._start = self._now()
        if not self.cuda:
            self._start -= waited
            self._host0 -= waited
        self._last = self._start
        self._entered = None
        self._bucket = None

    def host(self, phase: str, seconds: float, *, before: str = "") -> None:
        """A phase timed on the host (the data wait); the device time marks continue after it. ``before``: the
        phase of what ran since the previous mark besides that wait (a loop's forward and backward written before
        its `with st.step():`, as accumulation often is: compute; at a session's step start, the loop's own time
        between steps: ``phase`` itself), else that time is in no phase. ``before`` = ``phase`` on a GPU adds
        nothing: the device's events would count the host's wait a second time."""
        now = self._now()
        if before and (before != phase or not self.cuda):
            # on a CPU the wait is taken out of the span; a GPU's events see the device, idle while the host waits
            self._marks.append((before, (self._last, now if self.cuda else max(self._last, now - seconds))))
        self.totals[phase] += seconds
        if self.timeline is not None and seconds > 0:
            self._host_spans.append((phase, time.perf_counter() - seconds, seconds))
        self._last = now

    def mark(self, phase: str) -> None:
        """The phase that started at the previous mark ends now (one span with the previous mark's, when that is
        the same phase and ends where this one starts: the optimizer's pre- and post-hook marks and the step's)."""
        now = self._now()
        if self._marks and self._marks[-1][0] == phase and self._marks[-1][1][1] is self._last:
            self._marks[-1] = (phase, (self._marks[-1][1][0], now))
        else:
            self._marks.append((phase, (self._last, now)))
        self._last = now

    def optimizer_starting(self) -> None:
        """An optimizer's step begins (a step pre-hook): what ran since the previous mark was forward and backward
        when no backward was marked since then (a loop calling loss.backward() itself, not st.backward(): it
        read compute 0%, its forward and backward counted as optim), else what followed backward (clipping, the
        guard): optim. The optimizer's own step is optim too (optimizer_done)."""
        last = self._marks[-1][0] if self._marks else ""
        if last in ("compute", "comm", "pre_comm", "pipeline"):
            self.mark("optim")
        else:
            self.backward_done()

    def optimizer_done(self) -> None:
        """An optimizer's step returned (a step post-hook)."""
        self.mark("optim")

    def bucket_ready(self) -> None:
        """From the DDP comm hook: a gradient bucket goes to the all-reduce now (the last call of a
        backward is when this rank's compute was done)."""
        self._bucket = self._now()
        self.buckets += 1

    def collective_entered(self) -> None:
        """Under FSDP: the step's first collective (the root's all-gather, as its forward starts) begins now.
        Every later all-gather and reduce-scatter may wait for a slower rank, so this is the last point
        before which a rank's time is its own: ``pre_comm`` ends here, and a data or copy straggler shows
        (a compute straggler under FSDP does not: the others wait for it inside forward and backward)."""
        if self._entered is None:
            self._entered = self._now()

    def backward_done(self) -> None:
        """Backward returned: split it into compute and exposed communication."""
        now = self._now()
        if self._bucket is None:
            self._marks.append(("compute", (self._last, now)))
        else:
            self._marks.append(("compute", (self._last, self._bucket)))
            self._marks.append(("comm", (self._bucket, now)))
            self._marks.append(("pre_comm", (self._start, self._bucket)))
            self._bucket = None
        self._last = now

    def pipeline_done(self, busy: Any) -> None:
        """A pipeline stage's step (PipelineRunner.step) returned: of the time since the previous mark, ``busy``
        (a reading with seconds(): the rank's own forward, backward and loss, resolved at collection) is compute,
        the rest waiting for the other stages and replicas (module docstring)."""
        now = self._now()
        self._marks.append(("pipeline", (self._last, now, busy)))
        self._last = now

    def end(self, step: int = 0) -> None:
        """The step (number ``step``, for the timeline) ends now."""
        now = self._now()
        self._marks.append(("step", (self._start, now)))
        if not any(p in ("pre_comm", "pipeline") for p, _ in self._marks):  # no DDP all-reduce: FSDP's first collective, or
            entered = self._entered if self._entered is not None else now  # one rank: all of it
            self._marks.append(("pre_comm", (self._start, entered)))
        if self.cuda:
            self._pending.append(self._marks)
            self._pending_steps.append((step, self._host0, self._host_spans))
        else:
            self._add(self._marks, (step, self._host0, self._host_spans))
        self.steps += 1

    def add(self, phase: str, seconds: float) -> None:
        """Time measured outside the step (the checkpoint's stall), charged to the current interval."""
        self.totals[phase] += seconds
        self.totals["step"] += seconds
        if self.timeline is not None:
            self.timeline.add(phase, time.perf_counter() - seconds, seconds)

    # -- collection ---------------------------------------------------------------------------------------

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a  # CUDA: ms -> s

    def _add(self, marks: list[tuple[str, Any]], step: tuple[int, float, list[tuple[str, float, float]]]) -> None:
        """One step's marks into the totals (a pipeline's split into its own compute and its waiting), and with
        a timeline into its spans (``step``: the step's number, host start and host-timed spans)."""
        if self.timeline is not None:
            self._spans(marks, *step)
        waited, start, returned = 0.0, None, None
        for phase, span in marks:
            if phase == "pipeline":
                a, b, busy = span
                total = self._seconds(a, b)
                own = min(busy.seconds(), total)
                self.totals["compute"] += own
                self.totals["comm"] += total - own
                waited, returned = waited + total - own, b
                continue
            a, b = span
            self.totals[phase] += self._seconds(a, b)
            start = a if phase == "step" else start
        if returned is not None and start is not None:  # until the (last) pipeline step returned, less the waiting
            self.totals["pre_comm"] += self._seconds(start, returned) - waited

    def _spans(self, marks: list[tuple[str, Any]], number: int, host0: float,
               host_spans: list[tuple[str, float, float]]) -> None:
        """The step's phases as spans on the host's clock (a GPU's from its step-start event, placed at ``host0``);
        pre_comm, a span over others, is left out."""
        first = next(span[0] for phase, span in marks if phase == "step")

        def at(mark: Any) -> float:
            return host0 + first.elapsed_time(mark) / 1000.0 if self.cuda else mark
        spans = list(host_spans)
        for phase, span in marks:
            if phase != "pre_comm":
                spans.append((phase, at(span[0]), self._seconds(span[0], span[1])))
        self.timeline.add_step(number, spans)

    def collect(self) -> list[float]:
        """Mean seconds per step of every phase (PHASES order) over the interval, then start a new one."""
        if self._pending:
            waited = time.perf_counter()
            self._pending[-1][-1][1][1].synchronize()  # the interval's last event: all earlier ones are done
            self.lead_s = time.perf_counter() - waited
            for marks, step in zip(self._pending, self._pending_steps):
                self._add(marks, step)
            self._pending, self._pending_steps = [], []
        steps = max(self.steps, 1)
        out = [self.totals[p] / steps for p in PHASES]
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        return out


class NullTimer(StepTimer):
    """Phase timing off (log.phase_times=false): every mark is a no-op."""

    def start(self, *, waited: float = 0.0) -> None: ...
    def host(self, phase: str, seconds: float, *, before: str = "") -> None: ...
    def mark(self, phase: str) -> None: ...
    def optimizer_starting(self) -> None: ...
    def optimizer_done(self) -> None: ...
    def bucket_ready(self) -> None: ...
    def collective_entered(self) -> None: ...
    def pipeline_done(self, busy: Any) -> None: ...
    def backward_done(self) -> None: ...
    def end(self, step: int = 0) -> None: ...
    def add(self, phase: str, seconds: float) -> None: ...

    def collect(self) -> list[float]:
        return [0.0] * len(PHASES)


def attach_comm_hook(model: torch.nn.Module, timer: StepTimer | None, *, overlap: bool = True,
                     probe: Any = None) -> bool:
    """DDP's all-reduce through a hook that tells the timer when each bucket is ready (the same arithmetic
    as DDP's built-in: divide by the world size, sum). With ``overlap=False`` every bucket's all-reduce is
    held back until the last bucket is ready, as if DDP did not overlap communication with backward: that
    shows what the overlap buys. ``probe`` (observe/noise_scale.py GradProbe): each bucket's squared norm
    before the reduction, this rank's own gradient (one DDP comm hook per model: it shares this one).
    Returns False (and does nothing) when the model is not DDP-wrapped, or when there is nothing to time,
    change or measure."""
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain.observe.noise_scale import squared_norm

    if not isinstance(model, DistributedDataParallel) or (timer is None and overlap and probe is None):
        return False
    held: list[tuple[Any, torch.futures.Future]] = []

    def hook(group, bucket):
        if timer is not None:
            timer.bucket_ready()
        if probe is not None:
            probe.add_small(squared_norm(bucket.buffer()))
        if overlap:
            return _allreduce(group, bucket)
        mine: torch.futures.Future = torch.futures.Future()
        held.append((bucket, mine))
        if bucket.is_last():
            for b, fut in held:
                _allreduce(group, b).then(lambda done, fut=fut: fut.set_result(done.value()))
            held.clear()
        return mine

    model.register_comm_hook(None, hook)
    return True


def _allreduce(group: Any, bucket: Any) -> torch.futures.Future:
    """A bucket's mean over the group, as DDP's built-in all-reduce and torch's allreduce_hook compute it, with
    the result handed over by _handed."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer().div_(group.size()), group=group, async_op=True)
    return work.get_future().then(lambda done: _handed(done.value()[0]))


_kept = threading.local()  # per Python thread state: set once this thread's state is kept for good


def _handed(value: Any) -> Any:
    """A bucket's all-reduce callback, which runs on the thread that completed it (one of Gloo's): ``value``, the
    bucket's mean (and, without overlap, what hands it to the held future runs next on that same thread). That
    thread keeps the Python thread state it was given to run this, for good.
    Without, every bucket of every step made and dropped one (PyGILState_Ensure / Release); making one takes the
    interpreter's thread list lock without the GIL, and a fork() at that moment (a DataLoader starting its worker
    processes after a step, as an evaluation's loader did) left a child that waits for that lock forever, inside
    os.fork (CPython 3.11: PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept). Measured: 8 children of
    18,000 forks made right after a backward hung with torch's own allreduce_hook, none of 18,000 with this
    (benchmarks/fork_after_step.py, RESULTS.md section 18). One state per Gloo thread, made once."""
    if not getattr(_kept, "yes", False):
        ctypes.pythonapi.PyGILState_Ensure()  # never released: the state lives as long as its thread
        _kept.yes = True
    return value


def attach_forward_mark(model: torch.nn.Module, timer: StepTimer | None) -> bool:
    """Under FSDP or tensor parallelism, tell the timer when the root's forward is about to start the step's
    first collective (FSDP's all-gather, TP's first all-reduce or all-gather): a forward pre-hook placed ahead
    of fully_shard's own (a pipeline stage's runner marks its step itself, which takes precedence). Returns
    False (and does nothing) for a model of plain tensors (DDP times its all-reduce through the comm hook), or
    when there is nothing to time."""
    from scaletrain.parallel import has_dtensors

    if timer is None or not has_dtensors(model):
        return False

    def entered(module: torch.nn.Module, args: Any) -> None:
        # a model the user compiles after set-up (torch.compile(st.setup(model)[0])) traces its hooks: the
        # host's clock is no tensor op, and reading it there broke the graph at the root (a warning, and a
        # step cut in two); compiled, the step's collectives are timed with its compute
        if not torch.compiler.is_compiling():
            timer.collective_entered()

    model.register_forward_pre_hook(entered, prepend=True)
    return True
