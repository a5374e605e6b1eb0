"""torch.compile and bf16 autocast change how the step is computed, not what it computes."""

from __future__ import annotations

import pytest
import torch
from scratch import scratch_dir

from scaletrain import runtime
from scaletrain.config import load
from scaletrain.data import digits
from scaletrain.train.precision import autocast, grad_scaler
from scaletrain.train.run import open_stepper, step

STEPS = 20


def _train(**overrides):
    cfg = load(None, {"model.name": "mlp", "optim.name": "sgd", "optim.lr": 0.1, "dist.device": "cpu",
                      "run.dir": scratch_dir(), **overrides})
    job, batches = open_stepper(cfg, runtime.init(cfg.dist), digits(0.2))
    losses = [step(job, batches).item() for _ in range(STEPS)]
    job.st.close(finished=False)
    return losses, {k: v.detach().clone() for k, v in job.module.state_dict().items()}


def test_compiled_training_matches_eager():
    eager_losses, eager = _train()
    compiled_losses, compiled = _train(**{"train.compile": True})
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    for name, ref in eager.items():  # measured: worst 4.9e-7 relative after 20 steps
        assert ((compiled[name] - ref).norm() / ref.norm()).item() < 1e-5, name


def test_bf16_autocast_tracks_fp32():
    fp32_losses, _ = _train()
    bf16_losses, bf16 = _train(**{"train.precision": "bf16-mixed"})
    assert bf16_losses != fp32_losses  # it did run in lower precision
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.03)  # bf16 keeps 8 mantissa bits
    assert all(v.dtype == torch.float32 for v in bf16.values())  # master weights stay fp32


def test_autocast_and_scaler_choices():
    cpu = torch.device("cpu")
    with autocast("bf16-mixed", cpu):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast("fp32", cpu):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    assert not grad_scaler("bf16-mixed", cpu).is_enabled()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_transformer_encoder_evaluates_under_cpu_bf16():
    """torch's fused inference path for nn.TransformerEncoderLayer checks only CUDA's autocast: under the CPU's it
    raised "expected scalar type Float but found BFloat16" in the first evaluation (a padding mask with no padding).
    Inside our autocast the layers run their modules, within bf16's rounding of fp32, and the switch is put back."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 2).eval()
    x, no_padding = torch.randn(16, 12, 32), torch.zeros(16, 12, dtype=torch.bool)
    with torch.no_grad():
        want = encoder(x, src_key_padding_mask=no_padding)
        with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"), \
                torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own, as it was
            encoder(x, src_key_padding_mask=no_padding)
        with autocast("bf16-mixed", torch.device("cpu")):
            got = encoder(x, src_key_padding_mask=no_padding)
    assert (got.float() - want).abs().max().item() < 0.1  # bf16 keeps 8 bits: layer-normed outputs agree to ~1e-2
    assert torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize(("avx512_bf16", "amx", "precision", "device", "warned"), [
    (False, False, "bf16-mixed", "cpu", True),  # this VM: AVX2 only
    (True, False, "bf16-mixed", "cpu", False),
    (False, True, "bf16-mixed", "cpu", False),
    (False, False, "fp32", "cpu", False),
    (False, False, "bf16-mixed", "cuda", False),
])
def test_bf16_on_a_cpu_without_bf16_instructions_is_named_slow(monkeypatch, avx512_bf16, amx, precision, device,
                                                                warned):
    from scaletrain.train.precision import slow_here

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    said = slow_here(precision, torch.device(device))
    assert bool(said) == warned
    if warned:
        assert said.endswith("fix: --train.precision=fp32 on this machine") and "\n" not in said


def _recording_compile(monkeypatch) -> list[dict]:
    """Every nn.Module.compile call's options, the call itself left to run."""
    calls: list[dict] = []
    real = torch.nn.Module.compile

    def compile(self, *args, **kwargs):
        calls.append(dict(kwargs))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile)
    return calls


def test_train_compile_mode_reaches_torch_compile_and_computes_the_same(monkeypatch):
    eager_losses, _ = _train()
    calls = _recording_compile(monkeypatch)
    tuned_losses, _ = _train(**{"train.compile": True, "train.compile_mode": "max-autotune-no-cudagraphs"})
    assert calls == [{"mode": "max-autotune-no-cudagraphs"}]  # the MLP has no blocks: compiled whole, once
    assert tuned_losses == pytest.approx(eager_losses, rel=1e-5)


@pytest.mark.parametrize("mode", [None, "default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"])
def test_the_mode_of_a_model_given_compiled_is_read_back(mode):
    from scaletrain.parallel import compile_mode

    assert compile_mode(torch.compile(torch.nn.Linear(2, 2), mode=mode)) == (mode or "default")


def test_a_model_given_compiled_is_compiled_again_in_its_own_mode(monkeypatch, tmp_path):
    import scaletrain

    calls = _recording_compile(monkeypatch)
    with scaletrain.session({"run.dir": str(tmp_path / "run"), "dist.device": "cpu", "train.max_steps": 1}) as st:
        st.setup(torch.compile(torch.nn.Linear(4, 2), mode="reduce-overhead"),
                 lambda params: torch.optim.SGD(params, lr=0.1))
        assert st.compile_mode == "reduce-overhead"
    assert calls == [{"mode": "reduce-overhead"}]
    with scaletrain.session({"run.dir": str(tmp_path / "run2"), "dist.device": "cpu", "train.max_steps": 1,
                             "train.compile": True, "train.compile_mode": "max-autotune"}) as st:
        st.setup(torch.compile(torch.nn.Linear(4, 2), mode="reduce-overhead"),
                 lambda params: torch.optim.SGD(params, lr=0.1))  # the config's mode wins over the model's
    assert calls[1:] == [{"mode": "max-autotune"}]


def test_a_compile_mode_without_compile_is_refused():
    from scaletrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.compile_mode = .reduce-overhead.*fix: config=\{\"train.compile\": True\}"):
        load("digits", {"train.compile_mode": "reduce-overhead"})


def test_half_precision_outputs_come_back_fp32_in_a_dataclass_too():
    """A set-up model's outputs outside an autocast are handed back as fp32 whatever holds them: a plain or frozen
    dataclass (rebuilt, its type kept) as a tensor, tuple, dict or ModelOutput already were."""
    import dataclasses

    from scaletrain.train.precision import _to_fp32

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        aux: list
        step: int = 0

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        logits: torch.Tensor

    half = torch.ones(2, dtype=torch.bfloat16)
    out = _to_fp32(Out(half, [half, torch.ones(1, dtype=torch.float16)], step=3))
    assert type(out) is Out and out.step == 3
    assert [out.logits.dtype, *(t.dtype for t in out.aux)] == [torch.float32] * 3
    nested = _to_fp32({"inner": Frozen(half), "ids": torch.ones(2, dtype=torch.long)})
    assert type(nested["inner"]) is Frozen and nested["inner"].logits.dtype == torch.float32
    assert nested["ids"].dtype == torch.long


def test_a_set_up_models_cpu_autocast_does_not_break_a_graph_the_user_compiles():
    """A session's model under bf16-mixed runs its forward in the run's autocast (precision.autocast_forward); on a
    CPU that context also turns torch's fused attention fast path off and back on, which is no tensor op: a loop
    compiling the model after set-up broke its graph there. Traced, the switch is left alone; eager, it is turned
    off inside and restored after."""
    from torch import nn
    from torch._dynamo.utils import counters

    from scaletrain.train.precision import autocast, autocast_forward

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    autocast_forward(model, lambda: autocast("bf16-mixed", torch.device("cpu")))
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="eager")(torch.randn(3, 4))  # the breaks are Dynamo's
    assert out.dtype == torch.float32
    assert not counters["graph_break"] and counters["frames"]["total"] == 1
    seen = []
    model[0].register_forward_hook(lambda *_: seen.append(torch.backends.mha.get_fastpath_enabled()))
    was = torch.backends.mha.get_fastpath_enabled()
    model(torch.randn(3, 4))
    assert seen == [False] and torch.backends.mha.get_fastpath_enabled() == was
