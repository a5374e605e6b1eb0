"""The GPU path: the same code with another device. Skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import load
from scaletrain.train.run import run

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_digits_trains_on_one_gpu(precision, tmp_path):
    cfg = load("digits", {"run.dir": str(tmp_path / precision), "train.precision": precision,
                          "train.epochs": 10, "train.progress": False})
    summary = run(cfg)
    assert summary["device"].startswith("cuda") and summary["world_size"] == 1
    assert summary["eval"]["accuracy"] >= 0.95
    assert summary["peak_mem_bytes"] > 0


def test_a_session_under_fp16_scales_steps_and_refuses_a_bare_step(tmp_path):
    """st.optimizer_step under fp16-mixed: the loss scaler unscales and steps, its scale goes into the
    checkpoint, and opt.step() on scaled gradients is one clear error."""
    import scaletrain
    from scaletrain.errors import UserError

    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    cfg = {"run.dir": str(tmp_path / "fp16"), "train.precision": "fp16-mixed", "train.max_steps": 40,
           "log.every": 10, "checkpoint.every": 20, "data.batch_size": 32}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)),
                              lambda p: torch.optim.AdamW(p, lr=1e-2))
        first = None
        while not st.done:
            for xb, yb in st.loader((x, y)):
                with st.step():
                    with st.autocast():
                        loss = torch.nn.functional.cross_entropy(model(xb), yb)
                    st.backward(loss)
                    st.optimizer_step(opt)
                    opt.zero_grad(set_to_none=True)
                    st.log(loss=loss)
                first = first if first is not None else float(loss)
                if st.done:
                    break
        assert st.scaler.is_enabled() and st.scaler.get_scale() > 0
        assert float(loss) < first  # it learns through the scaler
        with pytest.raises(UserError, match=r"optimizer.step\(\) under train.precision=fp16-mixed"), st.step():
            st.backward(torch.nn.functional.cross_entropy(model(x[:32].cuda()), y[:32].cuda()))
            opt.step()
    trainer = (tmp_path / "fp16" / "checkpoints" / "step-00000040" / "trainer.json").read_text()
    assert '"scaler"' in trainer and '"scale"' in trainer


@pytest.mark.parametrize("attention", ["flash", "efficient"])
def test_train_attention_picks_the_kernel_and_keeps_the_losses(attention, tmp_path):
    """The same bf16 GPT steps under PyTorch's choice and under another kernel: the chosen kernel is the one
    that ran (the profiler's op names) and the losses agree to bf16's rounding."""
    from torch.profiler import ProfilerActivity, profile

    base = {"train.precision": "bf16-mixed", "train.max_steps": 6, "log.every": 3, "train.progress": False,
            "train.eval_batches": 1, "data.batch_size": 8}
    auto = run(load("gpt-stdlib", {**base, "run.dir": str(tmp_path / "auto")}))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        chosen = run(load("gpt-stdlib", {**base, "run.dir": str(tmp_path / attention), "train.attention": attention}))
    torch.backends.cuda.enable_cudnn_sdp(True)  # back to PyTorch's choice for the tests after this one
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    names = {e.key for e in prof.key_averages()}
    assert f"aten::_scaled_dot_product_{'flash' if attention == 'flash' else 'efficient'}_attention" in names
    assert "aten::_scaled_dot_product_cudnn_attention" not in names
    assert chosen["eval"]["loss"] == pytest.approx(auto["eval"]["loss"], rel=2e-2)
