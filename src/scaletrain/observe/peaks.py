"""Dense peak FLOP/s of the GPUs scaletrain knows, by the number format a run's matmuls compute in.

Pure data and arithmetic, no torch: the planner's catalog and the CLI read it without paying for torch's
import (seconds), and MFU (observe/throughput.py) reads the same numbers.
"""

from __future__ import annotations

# (name fragment, {precision: FLOP/s}), the first match wins (so "H100 PCIe" before "H100").
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM
    ("H200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
]


def compute_format(precision: str, *, tf32: bool) -> str:
    """The number format a run's matmuls compute in: bf16 | fp16 for the mixed modes, else tf32 (train.tf32)
    or fp32."""
    if precision == "bf16-mixed":
        return "bf16"
    if precision == "fp16-mixed":
        return "fp16"
    return "tf32" if tf32 else "fp32"


def peak_flops(name: str, precision: str, *, tf32: bool) -> float | None:
    """Dense peak FLOP/s of the GPU called ``name`` in the format a run computes in (compute_format; fp16 at
    the bf16 rate where the table has no fp16 of its own), or None when the GPU or its rate is not in PEAKS."""
    table = next((peaks for key, peaks in PEAKS if key in name), None)
    if table is None:
        return None
    key = compute_format(precision, tf32=tf32)
    if key == "fp16" and key not in table:
        key = "bf16"
    return table.get(key) or None
