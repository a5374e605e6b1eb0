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
