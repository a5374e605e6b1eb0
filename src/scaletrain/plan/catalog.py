"""The accelerators a plan can be made for: memory, peak FLOP/s, and the links between them.

Memory is what ``nvidia-smi --query-gpu=memory.total`` reports (for the H100 and the H200 as read on the lent
machines, benchmarks/RESULTS.md 5b; the others from their 40/80 GiB, 24 and 48 GB parts). Peaks are the dense
tensor-core rates of observe.peaks.PEAKS (the vendors' data sheets), read through peak_flops as MFU reads
them: an fp32 run at the TF32 rate when train.tf32 is on, else at the fp32 rate. Links are the data-sheet rates
per GPU and direction: NVLink 4 (H100/H200 SXM) 900 GB/s both ways -> 450, NVLink 3 (A100 SXM) 300, PCIe 4.0 x16
(L4, L40S) 32. Between machines the rate is the plan's --net-gbps (default 400 Gb/s per GPU, one NDR
InfiniBand port per GPU as on the common 8-GPU nodes). Real all-reduces reach a fraction of a link's rate
(``scaletrain bench allreduce`` measures it), so a plan's communication time is a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.observe.peaks import peak_flops

MIB = 2**20


@dataclass(frozen=True)
class Accelerator:
    key: str
    name: str  # as torch.cuda.get_device_name says it (the PEAKS fragment)
    memory_bytes: int
    link_bytes_per_s: float  # to the other GPUs of its machine, per direction

    def peak(self, precision: str, *, tf32: bool) -> float:
        """Dense FLOP/s for the format a run computes in (fp32 runs: TF32 tensor cores when ``tf32``)."""
        peak = peak_flops(self.name, precision, tf32=tf32)
        assert peak is not None, f"{self.name} has no {precision} (tf32={tf32}) rate in observe.peaks.PEAKS"
        return peak


ACCELERATORS = {a.key: a for a in (
    Accelerator("h100", "NVIDIA H100 80GB HBM3", 81_559 * MIB, 450e9),
    Accelerator("h200", "NVIDIA H200", 143_771 * MIB, 450e9),
    Accelerator("a100-80gb", "NVIDIA A100-SXM4-80GB", 81_920 * MIB, 300e9),
    Accelerator("a100-40gb", "NVIDIA A100-SXM4-40GB", 40_960 * MIB, 300e9),
    Accelerator("l40s", "NVIDIA L40S", 46_068 * MIB, 32e9),
    Accelerator("l4", "NVIDIA L4", 23_034 * MIB, 32e9),
)}


@dataclass(frozen=True)
class MeasuredMfu:
    """One measured run a plan's default MFU comes from: steady-state MFU without recompute, bf16."""

    accelerators: tuple[str, ...]  # the catalog keys it stands for (the H200 computes at the H100's peak)
    compiled: bool  # train.compile
    params: float  # the model's parameters
    tokens: int  # tokens per GPU per step (a larger batch keeps the GPU busier: 41% at 16 x 1024, 46.5% at 64)
    mfu: float
    source: str


# The default MFU of a plan (--mfu and --calibrate replace it): the measured run on the same accelerator with the
# same train.compile nearest in size (log scale), then nearest in tokens per GPU step; where none was measured,
# FALLBACK_MFU, said as assumed.
DEFAULT_MFU = (
    MeasuredMfu(("h100", "h200"), False, 85e6, 16 * 1024, 0.30, "GPT-2 124M shape (byte vocabulary) through "
                "scaletrain train, eager: ~30% in steady state (benchmarks/RESULTS.md 5b)"),
    MeasuredMfu(("h100", "h200"), True, 124e6, 16 * 1024, 0.41, "GPT-2 124M through scaletrain train, compiled, "
                "its defaults, batch 16: 41.1% (H100), 40.9% (H200) in steady state (benchmarks/RESULTS.md 5d, 5e)"),
    MeasuredMfu(("h100", "h200"), True, 124e6, 64 * 1024, 0.465, "GPT-2 124M through scaletrain train, compiled, "
                "batch 64: 46.5% (H200, its defaults), 46.7% (H100, no biases) (benchmarks/RESULTS.md 5d, 5e)"),
    MeasuredMfu(("h100", "h200"), True, 1.1e9, 16 * 1024, 0.50, "a ~1B GPT through scaletrain train, compiled, "
                "batch 16: 49.2-50.5% compiled block by block as FSDP runs, 55.2-55.9% compiled whole "
                "(benchmarks/RESULTS.md 5d, 5e)"),
)
FALLBACK_MFU = 0.40


@dataclass(frozen=True)
class CompiledActivations:
    """One measured ratio of the activations torch.compile keeps to those the planner measures eagerly (on fake
    tensors): its fusions keep fewer intermediates, the fused loss's chunk buffers above all."""

    whole: bool  # compiled as one graph (DDP, one process) or block by block (FSDP)
    loss: str  # model.loss: split or fused
    bias: bool  # model.bias: with biases inductor keeps more (0.40-0.43 against 0.36-0.38 at 124M, fused)
    params: float  # the model's parameters
    ratio: float  # measured / planned eagerly (for FSDP: its bf16 parameters' eager measurement)
    source: str


# The built-in GPT's compiled activations, bf16-mixed (benchmarks/RESULTS.md 5d, 5e): the ratio of the nearest
# measured run in size with the same compile scope and loss, and of those the one with the same model.bias;
# another model is planned eagerly (an overestimate under compile, which --calibrate with one's own runs corrects).
COMPILED_ACTIVATIONS = (
    CompiledActivations(True, "split", True, 124e6, 0.55, "H100, GPT-2 124M compiled whole, split loss: 0.533-0.552"),
    CompiledActivations(True, "fused", False, 124e6, 0.37,
                        "H100, GPT-2 124M without biases compiled whole, fused loss: 0.361-0.395"),
    CompiledActivations(True, "fused", True, 124e6, 0.42,
                        "H200, GPT-2 124M (its biases) compiled whole, fused loss: 0.404 (batch 16), 0.428 (64)"),
    CompiledActivations(True, "fused", False, 1.1e9, 0.63,
                        "a ~1B GPT without biases compiled whole, fused loss: 0.625 (H100), 0.630 (H200)"),
    CompiledActivations(False, "fused", False, 1.1e9, 0.86,
                        "a ~1B GPT without biases compiled block by block under FSDP, fused loss: 0.857 (H100 "
                        "and H200: 26.04 GB of 30.37 GB planned eagerly)"),
)


def compiled_activations(*, whole: bool, loss: str, bias: bool, params: float) -> CompiledActivations | None:
    """The measured ratio nearest in size (log scale) with this compile scope and loss, the same model.bias
    first among runs of one size; None where none."""
    runs = [m for m in COMPILED_ACTIVATIONS if m.whole == whole and m.loss == loss]
    return min(runs, key=lambda m: (_size_distance(params, m.params), m.bias != bias)) if runs else None


def _size_distance(params: float, measured: float) -> float:
    """How far a model of ``params`` parameters is from a measured one, on a log scale (rounded, so that runs
    of one size tie and the second key decides)."""
    import math

    return round(abs(math.log(max(params, 1.0) / measured)), 6)


def default_mfu(accelerator: str, *, compiled: bool, params: float, tokens: float = 0) -> tuple[float, str]:
    """(MFU, where it comes from) for a plan on ``accelerator`` of a model of ``params`` parameters that reads
    ``tokens`` per GPU per step (0: a model reading no tokens, matched by size alone)."""
    import math

    runs = [m for m in DEFAULT_MFU if accelerator in m.accelerators and m.compiled == compiled]
    if not runs:
        return FALLBACK_MFU, (f"not measured on {accelerator} with train.compile={str(compiled).lower()}: "
                              f"assumed; --mfu or --calibrate with your own runs")

    def distance(m: MeasuredMfu) -> tuple[float, float]:
        return _size_distance(params, m.params), abs(math.log(tokens / m.tokens)) if tokens > 0 else 0.0

    near = min(runs, key=distance)
    return near.mfu, f"the nearest measured run: {near.source}"
