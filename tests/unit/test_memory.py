"""Memory accounting: model state from live tensors, measured activations, the auto rule and OOM advice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.models import GPT
from scaletrain.observe import metrics
from scaletrain.observe.memory import (
    MemoryBreakdown,
    choose_strategy,
    estimate_activation_bytes,
    estimate_model_state,
    estimate_step,
    measure_step,
    model_state_bytes,
    oom_advice,
    peak_bytes,
)

GB = 10**9


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(256, 128, 4, 4, 128)  # the gpt-stdlib recipe's shape (bytes, seq 128, 4 x 128)


def test_model_state_counts_live_tensors_once():
    model = _gpt()
    n = sum(p.numel() for p in model.parameters())  # parameters() already yields the tied head once
    assert model_state_bytes(model).as_dict() == {"params_bytes": 4 * n, "grads_bytes": 0, "optim_bytes": 0,
                                                  "activations_bytes": 0}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 128))
    model(x).sum().backward()
    opt.step()
    state = model_state_bytes(model, opt)
    tensors = len(list(model.parameters()))
    # AdamW: exp_avg and exp_avg_sq per parameter (fp32) + one fp32 scalar "step" tensor per parameter
    assert (state.params_bytes, state.grads_bytes, state.optim_bytes) == (4 * n, 4 * n, 8 * n + 4 * tensors)
    assert estimate_model_state(model, "adamw").model_state_bytes == 16 * n  # the rule before training
    assert estimate_model_state(model, "adamw", shard=4).params_bytes == n


def test_measured_activations_scale_linearly_and_leave_the_model_alone():
    model = _gpt()
    sample = torch.randint(0, 256, (128,))
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    estimate = estimate_activation_bytes(model, sample, 8)
    measured = measure_step(model, sample.expand(8, 128).contiguous()).activations_bytes
    # measured at batch 1 and 2, extrapolated to 8; what batch 8 really keeps (35.8 MB here) agrees
    assert abs(estimate - measured) <= 0.01 * measured, (estimate, measured)
    assert measured > 8 * 128 * 128 * 4 * 4  # far more than the 4 blocks' inputs alone
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    bf16 = estimate_activation_bytes(model, sample, 8, precision="bf16-mixed")
    assert 0.4 * measured < bf16 < 0.8 * measured  # bf16 activations, plus fp32 the loss and norms keep


class Shifting(nn.Module):
    """A step whose peak moves with the batch: at batch 1 and 2 it is a weight-sized temporary (2 MB, no batch
    in it, as autocast's bf16 copies of the weights are), from batch 5 on backward's gradient of a (B, 128, 1024)
    product (0.5 MB a sample). ``transposed``: a copy batch 1 does not make (a (1, n) tensor transposed is
    contiguous already), so batch 1 runs other ops than batch 2."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.w, self.head, self.transposed = nn.Parameter(torch.randn(512, 1024)), nn.Linear(1024, 3), transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            x = x.t().contiguous().t()
        scaled = (self.w * 2).sum(0)
        return self.head((x[:, None, :].expand(-1, 128, -1) * scaled).mean(1))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_peak_at_any_batch_is_the_steps_highest_moment_not_a_line_through_two_peaks(transposed):
    model, sample = Shifting(transposed), torch.randn(1024)

    def real(b: int) -> int:
        return measure_step(model, sample.expand(b, -1).contiguous(), backward=True, grads_allocated=True).peak_bytes

    for b in (1, 2, 3, 8, 32):  # to the byte at every batch
        assert estimate_step(model, sample, b).peak_bytes == real(b), b
    one, two = real(1), real(2)
    assert one + 31 * (two - one) < 0.3 * real(32)  # the line through batch 1's and 2's peaks: 3.5x low


def test_peak_memory_moved_not_duplicated():
    assert metrics.peak_memory_bytes is peak_bytes
    assert peak_bytes(torch.device("cpu")) > 10**7  # this process's peak RSS, in bytes


# The example of seed 002: an 8B model with AdamW in fp32 needs 32 + 32 + 64 GB, plus activations.
EIGHT_B = MemoryBreakdown(32 * GB, 32 * GB, 64 * GB, 10 * GB)
H100 = 80 * GB


@pytest.mark.parametrize(("replica", "world", "nnodes", "want", "words"), [
    (MemoryBreakdown(GB // 2, GB // 2, GB, 3 * GB), 8, 1, "ddp", ["= 5.00 GB) fits in 80% of 80.00 GB"]),
    (EIGHT_B, 8, 1, "fsdp", ["138.00 GB) exceeds 80% of 80.00 GB",
                             "128.00 GB / 8 + activations 10.00 GB = 26.00 GB"]),
    (EIGHT_B, 16, 2, "hsdp", ["over the 8 ranks of a machine", "= 26.00 GB"]),
    # 70B: one machine's 8 ranks cannot hold the state (1120 / 8 = 140 GB), all 32 can
    (MemoryBreakdown(280 * GB, 280 * GB, 560 * GB, 10 * GB), 32, 4, "fsdp",
     ["/ 32 + activations", "= 45.00 GB"]),
    (MemoryBreakdown(16 * GB, 16 * GB, 32 * GB, 2 * GB), 8, 1, "fsdp", ["66.00 GB) exceeds 80%"]),  # margin
    (EIGHT_B, 1, 1, "ddp", ["one rank, nothing to shard across", "does NOT fit"]),
    (MemoryBreakdown(280 * GB, 280 * GB, 560 * GB, 60 * GB), 8, 1, "fsdp", ["still over"]),
])
def test_auto_picks_ddp_when_a_replica_fits(replica, world, nnodes, want, words):
    choice, reason = choose_strategy(replica, H100, world_size=world, nnodes=nnodes)
    assert choice == want
    assert reason.startswith(f"auto -> {want}: ") and "\n" not in reason
    for word in words:
        assert word in reason, reason


def test_oom_advice_names_flags_and_keeps_the_global_batch():
    advice = oom_advice(MemoryBreakdown(GB, GB, 2 * GB, 90 * GB), capacity_bytes=H100, strategy="ddp",
                        world_size=8, batch_size=32, accum_steps=1)
    lines = advice.splitlines()
    assert lines[0] == ("memory per rank: params 1.00 GB + grads 1.00 GB + optimizer 2.00 GB + activations "
                        "90.00 GB = 94.00 GB; device 80.00 GB")
    assert "--memory.activation_checkpointing=full" in lines[2]  # activations dominate: their fix first
    assert "--data.batch_size=16 --train.accum_steps=2: the same global batch 256, activations 90.00 GB -> " \
           "45.00 GB" in advice
    assert "--parallel.strategy=fsdp: model state 4.00 GB -> 500 MB per rank" in advice
    assert "--train.precision=bf16-mixed" in advice
    sharded = oom_advice(MemoryBreakdown(40 * GB, 40 * GB, 80 * GB, 5 * GB), capacity_bytes=H100,
                         strategy="fsdp", world_size=2, batch_size=4, accum_steps=2,
                         activation_checkpointing="full", precision="bf16-mixed")
    assert "--memory.cpu_offload=true" in sharded.splitlines()[2]  # model state dominates
    assert "activation_checkpointing" not in sharded and "--parallel.strategy" not in sharded
    # halved, since no split of the batch alone would fit
    assert "--data.batch_size=2 --train.accum_steps=4: the same global batch 16" in sharded
