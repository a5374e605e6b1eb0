"""Activation checkpointing changes what is kept for backward, not what backward computes.

On the gpt-stdlib recipe's GPT (4 blocks x 128, seq 128, bytes), with dropout so that recomputation must
replay the same masks: gradients with full and selective checkpointing equal those without (measured:
bitwise), and the memory the step holds is lower, measured two ways: bytes of live tensors over the step
(LiveBytes, exact), and the process's peak RSS in a fresh process (what peak_bytes reports on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from spawn_ranks import run_ranks

from scaletrain.models import GPT
from scaletrain.observe.memory import measure_step, peak_bytes
from scaletrain.parallel import apply_activation_checkpointing

MODES = ("none", "full", "selective")


def _gpt(mode: str, seq: int = 128, dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    model = GPT(256, seq, 4, 4, 128, dropout)
    apply_activation_checkpointing(model, mode)
    return model


def _loss(model: GPT, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def test_same_gradients_and_less_memory_kept():
    x = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))
    grads, steps = {}, {}
    for mode in MODES:
        model = _gpt(mode)
        torch.manual_seed(5)  # the same dropout masks in every mode
        _loss(model, x).backward()
        grads[mode] = {k: p.grad for k, p in model.named_parameters()}
        steps[mode] = measure_step(model, x, backward=True,
                                   loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), x.flatten()))
    for mode in ("full", "selective"):
        worst = max((grads[mode][k] - g).abs().max().item() for k, g in grads["none"].items())
        assert worst <= 1e-6, (mode, worst)
    # measured: kept after forward 32.8 MB (none), 9.7 MB (selective), 2.4 MB (full);
    # step peaks 33.9 / 16.1 / 12.2 MB
    kept = {m: s.activations_bytes for m, s in steps.items()}
    peak = {m: s.peak_bytes for m, s in steps.items()}
    assert kept["full"] < 0.2 * kept["none"] and kept["full"] < kept["selective"] < 0.5 * kept["none"]
    assert peak["full"] < peak["selective"] < peak["none"]


def _rss_after_each(rank: int, world: int) -> dict[str, int]:
    """Peak RSS after a forward/backward in each mode, the one expected to hold least first: peak RSS only
    grows, so a later mode raises it only by holding more than everything before it."""
    cpu = torch.device("cpu")
    models = {m: _gpt(m, seq=256, dropout=0.0) for m in ("full", "selective", "none")}
    x = torch.randint(0, 256, (32, 256))
    peaks = {"start": peak_bytes(cpu)}
    for mode, model in models.items():
        _loss(model, x).backward()
        peaks[mode] = peak_bytes(cpu)
    return peaks


def test_lower_peak_rss_in_a_fresh_process(monkeypatch):
    # Fixed mmap threshold: large tensors are mapped and unmapped, so RSS follows the live tensors
    # (glibc otherwise raises the threshold after the first frees and keeps freed memory in its heap).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    (peaks,) = run_ranks(_rss_after_each, 1)
    mb = 1e6
    # measured: peak RSS 301 MB at the start, 449 MB after full, 556 MB after selective, 660 MB after none
    assert peaks["none"] - peaks["selective"] > 50 * mb, peaks
    assert peaks["none"] - peaks["full"] > 100 * mb, peaks
