"""Activation checkpointing changes what is kept for backward, not what backward computes.

On the gpt-stdlib recipe's GPT (4 blocks x 128, seq 128, bytes), with dropout so that recomputation must
replay the same masks: gradients with full and selective checkpointing equal those without (measured:
bitwise), and the memory the step holds is lower, measured two ways: bytes of live tensors over the step
(LiveBytes, exact), and the process's peak RSS in a fresh process (what peak_bytes reports on a CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn_ranks import run_ranks

from scaletrain.models import GPT
from scaletrain.observe.memory import measure_step
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
                                   loss_fn=lambda out, _: F.cross_entropy(out.flatten(0, 1), x.flatten()))
    for mode in ("full", "selective"):
        worst = max((grads[mode][k] - g).abs().max().item() for k, g in grads["none"].items())
        assert worst <= 1e-6, (mode, worst)
    # measured: kept after forward 32.8 MB (none), 9.7 MB (selective), 2.4 MB (full);
    # step peaks 33.9 / 16.1 / 12.2 MB
    kept = {m: s.activations_bytes for m, s in steps.items()}
    peak = {m: s.peak_bytes for m, s in steps.items()}
    assert kept["full"] < 0.2 * kept["none"] and kept["full"] < kept["selective"] < 0.5 * kept["none"]
    assert peak["full"] < peak["selective"] < peak["none"]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def _rss_after_each(rank: int, world: int) -> dict[str, int]:
    """How far RSS rose above where it stood, over a forward/backward in each mode: the high-water mark is
    reset before each (Linux: writing 5 to /proc/self/clear_refs), so what the process did at start-up (or in
    another mode) cannot hide it."""
    models = {m: _gpt(m, seq=256, dropout=0.0) for m in ("full", "selective", "none")}
    x = torch.randint(0, 256, (32, 256))
    rises = {}
    for mode, model in models.items():
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kb("VmRSS")
        _loss(model, x).backward()
        rises[mode] = (_status_kb("VmHWM") - before) * 1024
        for p in model.parameters():
            p.grad = None
    return rises


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_lower_peak_rss_in_a_fresh_process(monkeypatch):
    # Fixed mmap threshold: large tensors are mapped and unmapped, so RSS follows the live tensors
    # (glibc otherwise raises the threshold after the first frees and keeps freed memory in its heap).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    (rises,) = run_ranks(_rss_after_each, 1, start_method="spawn")  # glibc reads the variable at start
    mb = 1e6
    # measured: peak RSS rises by 148 MB (full), 204 MB (selective), 302 MB (none) over the step
    assert rises["none"] - rises["selective"] > 50 * mb, rises
    assert rises["none"] - rises["full"] > 100 * mb, rises


def _hf(name: str, mode: str) -> torch.nn.Module:
    """A tiny GPT-2 (its KV cache passed to each block by position) or T5 (an encoder-decoder cache by keyword),
    both with use_cache on, as their configs default: a block that fills a cache in forward does not replay the
    same forward in backward."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32,
                                                                     n_layer=2, n_head=2))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0))
    model.train()
    apply_activation_checkpointing(model, mode)
    return model


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hugging_face_blocks_that_fill_a_cache_recompute_the_same_forward(name: str) -> None:
    """Under checkpointing their cache is left out (use_cache=False and no cache, by keyword or position, as
    transformers' own gradient checkpointing does): full and selective give the gradients of no checkpointing
    (they crashed: 'A different number of tensors was saved', 'aten.slice.Tensor ... not found in storage')."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids} if name == "gpt2" else \
        {"input_ids": ids, "decoder_input_ids": ids, "labels": ids}
    grads = {}
    for mode in MODES:
        model = _hf(name, mode)
        model(**batch).loss.backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for mode in ("full", "selective"):
        assert grads[mode].keys() == grads["none"].keys()
        for n, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-5, atol=1e-6, msg=f"{mode}: {n}")


class _BNBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


def _bn_net(mode: str, compiled: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_BNBlock(), _BNBlock(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    apply_activation_checkpointing(model, mode)
    return model, (torch.compile(model, backend="aot_eager") if compiled else model)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_batchnorm_running_statistics_are_updated_once_per_forward(compiled: bool) -> None:
    """The recomputed forward folded each batch into BatchNorm's running mean and variance a second time
    (num_batches_tracked 6 after 3 steps, and an evaluated model unlike the one trained without checkpointing).
    Three steps: the running statistics and the weights as without checkpointing, bitwise in eager; compiled
    (aot_eager: the graph's recompute is the partitioner's) the same, the forward graph updating them once."""
    x = torch.randn(3, 8, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (3, 8), generator=torch.Generator().manual_seed(2))
    states = {}
    for mode in MODES:
        model, run = _bn_net(mode, compiled)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            F.cross_entropy(run(x[i]), y[i]).backward()
            opt.step()
            opt.zero_grad()
        states[mode] = {k: v.clone() for k, v in model.state_dict().items()}
    assert states["none"]["0.bn.num_batches_tracked"].item() == 3
    for mode in ("full", "selective"):
        for k, v in states["none"].items():
            assert torch.equal(states[mode][k], v), (mode, k, (states[mode][k].float() - v.float()).abs().max())
