"""scaletrain plan: memory per GPU per layout, time and cost, and the choice, before a run.

The plan builds the model on fake tensors; what it measures there must be what a real model has: the
peak bytes of a real forward and backward beyond the model state to the byte, the model state of a real model
after a real AdamW step to the byte. The arithmetic of time and communication is checked against the formulas
the docs state, and the seed's example (an ~7B model with AdamW in fp32: 16 bytes per parameter before
activations) against H100s. train.tf32 picks the peak a plan's compute time (and MFU) is measured against, and
the output fits 80 columns unless --wide.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import load
from scaletrain.data import build_splits
from scaletrain.models import build_model
from scaletrain.observe.memory import estimate_activation_bytes, model_state_bytes
from scaletrain.observe.throughput import device_peak
from scaletrain.plan.catalog import ACCELERATORS
from scaletrain.plan.estimate import ModelFacts, layout, layout_memory, make_plan, measure_model
from scaletrain.train.precision import set_attention, set_tf32

SMALL = {"data.batch_size": 3, "data.seq_len": 64, "model.n_layer": 2, "model.n_embd": 64, "model.n_head": 4}
BIG = {"model.n_layer": 32, "model.n_embd": 4096, "model.n_head": 32, "model.vocab_size": 50304,
       "data.seq_len": 2048, "data.batch_size": 1}


def _facts(overrides: dict, recipe: str = "gpt-stdlib"):
    cfg = load(recipe, cli_overrides=overrides)
    splits = build_splits(cfg.data, cfg.model)
    sample = splits.train[0][0]
    return cfg, splits, sample, measure_model(cfg, splits.task, splits.info, sample)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_activations_on_fake_tensors_are_the_bytes_of_a_real_step(precision):
    cfg, splits, sample, facts = _facts({**SMALL, "train.precision": precision})
    real = build_model(cfg.model, splits.task, splits.info)
    assert facts.activations["none"] == estimate_activation_bytes(real, sample, 3, precision=precision,
                                                                  whole_step=True)
    if precision == "bf16-mixed":  # as FSDP runs it: bf16 parameters, no autocast copies of the weights
        low = build_model(cfg.model, splits.task, splits.info).to(torch.bfloat16)
        assert facts.activations["sharded-none"] == estimate_activation_bytes(low, sample, 3, whole_step=True)
        assert facts.activations["sharded-none"] < facts.activations["none"]
    assert facts.activations["full"] < facts.activations["none"]
    assert facts.units == 2 and facts.tokens_per_sample == 64


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_selective_checkpointing_on_fake_tensors_is_the_bytes_of_a_real_step(precision):
    """The dp x tp x pp plans' selective rows: the op-level policy's step measured on fake tensors is a real
    model's under the same policy to the byte, between none and full."""
    from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing

    cfg = load("gpt-stdlib", cli_overrides={**SMALL, "train.precision": precision})
    splits = build_splits(cfg.data, cfg.model)
    sample = splits.train[0][0]
    facts = measure_model(cfg, splits.task, splits.info, sample, modes=("none", "selective", "full"))
    real = build_model(cfg.model, splits.task, splits.info)
    apply_activation_checkpointing(real, "selective")
    assert facts.activations["selective"] == estimate_activation_bytes(real, sample, 3, precision=precision,
                                                                       whole_step=True)
    assert facts.activations["none"] > facts.activations["selective"] > facts.activations["full"]


def test_a_config_measured_again_at_another_batch_reuses_its_steps_and_plans_the_same(monkeypatch):
    """A plan measures its config again at the trainer's micro-batch (a pipeline's), and the blocks at 3 and 4 for
    each measurement: the same fake steps at batch 1 and 2, extrapolated to another batch size (the 405B plan took
    26.5 s of CPU, 20.1 s now). The second measurement builds no model, and equals a fresh one to the byte."""
    from scaletrain.plan import estimate

    _, splits, sample, _ = _facts({**SMALL, "model.n_layer": 9, "train.precision": "bf16-mixed"})
    at7 = load("gpt-stdlib", cli_overrides={**SMALL, "model.n_layer": 9, "train.precision": "bf16-mixed",
                                             "data.batch_size": 7})
    built = []
    monkeypatch.setattr(estimate, "_fake_model", lambda *a, _real=estimate._fake_model: built.append(a) or _real(*a))
    again = measure_model(at7, splits.task, splits.info, sample)
    assert built == []
    monkeypatch.setattr(estimate, "_POINTS", {})
    monkeypatch.setattr(estimate, "_COUNTS", {})
    monkeypatch.setattr(estimate, "_FLOPS", {})
    fresh = measure_model(at7, splits.task, splits.info, sample)
    assert built and again == fresh
    assert fresh.activations != _facts({**SMALL, "model.n_layer": 9, "train.precision": "bf16-mixed"})[3].activations


def test_a_deep_gpt_measured_at_3_and_4_blocks_is_the_whole_models_measure_to_the_byte():
    """measure_model extrapolates a GPT deeper than 8 blocks from 3 and 4 (its blocks are identical); under
    bf16 autocast with full checkpointing 2 blocks keep more than 3, the case that sets the depths."""
    from scaletrain.plan.estimate import _measure

    cfg, splits, sample, facts = _facts({**SMALL, "model.n_layer": 9, "train.precision": "bf16-mixed"})
    assert facts == _measure(cfg, splits.task, splits.info, sample)
    assert facts.units == 9


def test_model_state_is_what_a_real_model_holds_after_an_adamw_step():
    cfg, splits, _, facts = _facts(SMALL)
    model = build_model(cfg.model, splits.task, splits.info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.stack([splits.train[i][0] for i in range(3)]), torch.stack([splits.train[i][1] for i in range(3)])
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    live = model_state_bytes(model, opt)
    plan = make_plan(load("gpt-stdlib", cli_overrides={**SMALL, "dist.nproc": 4}), facts, ACCELERATORS["h100"],
                     total_steps=10, accum_steps=1, mfu=0.4, net_bytes_per_s=50e9, price_per_gpu_hour=None)
    ddp, fsdp = plan.layouts[0], plan.layouts[2]
    assert (ddp.strategy, fsdp.strategy) == ("ddp", "fsdp")
    # AdamW's step counters are 0-d tensors (4 bytes each): the plan counts the two moments per parameter
    steps = sum(4 for s in opt.state.values())
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optim_bytes + steps) == \
        (live.params_bytes, live.grads_bytes, live.optim_bytes)
    assert (fsdp.params_bytes, fsdp.grads_bytes, fsdp.optim_bytes) == \
        tuple(math.ceil(b / 4) for b in (ddp.params_bytes, ddp.grads_bytes, ddp.optim_bytes))
    # two units all-gathered (fp32 here) and one unit's fp32 gradients
    assert ddp.fsdp_buffers_bytes == 0 and fsdp.fsdp_buffers_bytes == facts.largest_unit * (2 * 4 + 4)


def test_time_and_communication_follow_the_stated_formulas():
    facts = _facts(SMALL)[3]
    kw = {"acc": ACCELERATORS["h100"], "precision": "fp32", "tf32": True, "batch_size": 3, "optimizer": "adamw",
          "mfu": 0.5, "net_bytes_per_s": 50e9}
    one = layout(facts, "ddp", "none", gpus_per_node=8, nodes=1, accum_steps=2, **kw)
    assert one.compute_s == pytest.approx(facts.flops_per_sample * 3 * 8 * 2 / (8 * 494e12 * 0.5), rel=1e-12)
    assert one.comm_s == pytest.approx(2 * 7 / 8 * 4 * facts.trainable / 450e9, rel=1e-12)
    full = layout(facts, "ddp", "full", gpus_per_node=8, nodes=1, accum_steps=2, **kw)
    assert full.compute_s == pytest.approx(one.compute_s * 4 / 3, rel=1e-12)  # one more forward
    fsdp = layout(facts, "fsdp", "none", gpus_per_node=8, nodes=1, accum_steps=2, **kw)
    # per micro-step two all-gathers (fp32 here), once per step the reduce-scatter
    assert fsdp.comm_s == pytest.approx((2 * 2 * 7 / 8 * 4 * facts.params + 7 / 8 * 4 * facts.trainable) / 450e9,
                                        rel=1e-12)
    two = layout(facts, "ddp", "none", gpus_per_node=8, nodes=2, accum_steps=2, **kw)
    assert two.comm_s == pytest.approx(2 * 15 / 16 * 4 * facts.trainable / 50e9, rel=1e-12)  # the slower link
    assert two.step_s == max(two.compute_s, two.comm_s)
    hsdp = layout(facts, "hsdp", "none", gpus_per_node=8, nodes=2, accum_steps=2, **kw)
    # shard within a machine over NVLink, all-reduce one shard's gradients between the 2 machines
    within = (2 * 2 * 7 / 8 * 4 * facts.params + 7 / 8 * 4 * facts.trainable) / 450e9
    assert hsdp.comm_s == pytest.approx(within + 2 * 1 / 2 * 4 * facts.trainable / 8 / 50e9, rel=1e-12)
    assert hsdp.params_bytes == math.ceil(4 * facts.params / 8)  # sharded over the 8 GPUs of a machine


def test_the_seeds_large_model_needs_sharding_on_h100s():
    facts = _facts(BIG)[3]
    assert 6.6e9 < facts.params < 6.7e9
    h100 = ACCELERATORS["h100"]

    def plan(gpus: int):
        c = load("gpt-stdlib", cli_overrides={**BIG, "dist.nproc": gpus})
        return make_plan(c, facts, h100, total_steps=1000, accum_steps=1, mfu=0.4, net_bytes_per_s=50e9,
                         price_per_gpu_hour=2.0)

    eight = plan(8)
    ddp = eight.layouts[0]
    assert ddp.params_bytes + ddp.grads_bytes + ddp.optim_bytes == 16 * facts.params  # 4 + 4 + 2 x 4 bytes
    assert not ddp.fits and eight.choice is not None and eight.choice.strategy == "fsdp"
    assert "ddp does not fit" in eight.reason
    assert eight.cost(eight.choice) == pytest.approx(1000 * eight.choice.step_s / 3600 * 8 * 2.0)
    alone = plan(1)
    assert alone.choice is None and "fits on" in alone.reason
    need = int(alone.reason.rsplit("fits on ", 1)[1].split()[0])
    kw = {"acc": h100, "nodes": 1, "precision": "fp32", "tf32": True, "batch_size": 1, "accum_steps": 1,
          "optimizer": "adamw", "mfu": 0.4, "net_bytes_per_s": 50e9}
    assert layout(facts, "fsdp", "full", gpus_per_node=need, **kw).fits
    assert not layout(facts, "fsdp", "full", gpus_per_node=need - 1, **kw).fits


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-stdlib", "--gpu", "a100-40gb", "--nproc", "4", "--price", "1.5", "--json", str(out),
                 *(f"--{k}={v}" for k, v in SMALL.items())]) == 0
    text = capsys.readouterr().out
    assert "plan: use ddp" in text and "a100-40gb" in text
    data = json.loads(out.read_text())
    assert [(r["strategy"], r["checkpointing"]) for r in data["layouts"]] == \
        [("ddp", "none"), ("ddp", "full"), ("fsdp", "none"), ("fsdp", "full")]
    assert data["world_size"] == 4 and data["global_batch"] == 12 and data["choice"]["strategy"] == "ddp"
    assert data["layouts"][0]["cost"] == pytest.approx(data["layouts"][0]["run_hours"] * 4 * 1.5)


def _plan_text(argv: list[str], capsys) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())  # rich's box characters are one column each


def test_tf32_sets_the_peak_and_the_compute_time():
    facts = _facts(SMALL)[3]
    h100 = ACCELERATORS["h100"]

    def plan(**train):
        cfg = load("gpt-stdlib", cli_overrides={**SMALL, "dist.nproc": 8, **train})
        return make_plan(cfg, facts, h100, total_steps=10, accum_steps=1, mfu=0.4, net_bytes_per_s=50e9,
                         price_per_gpu_hour=2.0)

    on, off = plan(), plan(**{"train.tf32": "false"})
    assert (on.tf32, off.tf32) == (True, False)  # the default, and the key parsed from the command line
    assert (on.peak, off.peak) == (494e12, 67e12)  # the H100 SXM's dense TF32 and fp32 rates
    for a, b in zip(on.layouts, off.layouts, strict=True):
        assert b.compute_s == pytest.approx(a.compute_s * 494 / 67, rel=1e-12)
        assert a.compute_s == pytest.approx(facts.flops_per_sample * 3 * (4 / 3 if a.checkpointing == "full" else 1)
                                            / (494e12 * 0.4), rel=1e-12)
        assert (b.comm_s, b.total_bytes) == (a.comm_s, a.total_bytes)
    mixed = [plan(**{"train.precision": "bf16-mixed", "train.tf32": t}) for t in ("true", "false")]
    assert mixed[0].peak == mixed[1].peak == 989e12  # bf16 matmuls: TF32 is not their rate


def test_tf32_in_the_commands_header_and_json(tmp_path, capsys):
    small = [*(f"--{k}={v}" for k, v in SMALL.items()), "--nproc", "2"]
    texts, compute = [], []
    for i, flag in enumerate(([], ["--train.tf32=false"])):
        out = tmp_path / f"plan{i}.json"
        texts.append(_plan_text(["gpt-stdlib", "--gpu", "h100", *small, *flag, "--json", str(out)], capsys))
        compute.append([r["compute_s"] for r in json.loads(out.read_text())["layouts"]])
    assert "494 TFLOP/s tf32" in texts[0] and "67 TFLOP/s fp32" in texts[1]
    assert compute[1] == pytest.approx([c * 494 / 67 for c in compute[0]], rel=1e-12)


def test_the_mfu_peak_follows_train_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert device_peak(cuda, "fp32", tf32=True) == ("NVIDIA H100 80GB HBM3", 494e12)
    assert device_peak(cuda, "fp32", tf32=False) == ("NVIDIA H100 80GB HBM3", 67e12)
    assert device_peak(cuda, "bf16-mixed", tf32=False)[1] == 989e12
    assert device_peak(torch.device("cpu"), "fp32", tf32=True) == ("cpu", None)


def test_set_tf32_sets_cudas_flags_and_leaves_a_cpus_alone():
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [f.allow_tf32 for f in flags]
    try:
        for on in (True, False):
            set_tf32(on, torch.device("cuda", 0))  # the flags are process-wide and settable without a GPU
            assert [f.allow_tf32 for f in flags] == [on, on]
        set_tf32(True, torch.device("cpu"))
        assert [f.allow_tf32 for f in flags] == [False, False]
    finally:
        for f, value in zip(flags, saved):
            f.allow_tf32 = value


def test_train_attention_leaves_one_kernel_and_math_and_auto_leaves_the_flags():
    b = torch.backends.cuda
    getters = (b.flash_sdp_enabled, b.cudnn_sdp_enabled, b.mem_efficient_sdp_enabled, b.math_sdp_enabled)
    setters = (b.enable_flash_sdp, b.enable_cudnn_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp)
    saved = [g() for g in getters]
    cuda = torch.device("cuda", 0)  # process-wide flags, settable without a GPU
    try:
        for choice, expected in {"flash": [True, False, False, True], "cudnn": [False, True, False, True],
                                 "efficient": [False, False, True, True], "math": [False, False, False, True]}.items():
            set_attention(choice, cuda)
            assert [g() for g in getters] == expected, choice
        set_attention("auto", cuda)  # a user's own setting (here: math only) stays
        set_attention("flash", torch.device("cpu"))
        assert [g() for g in getters] == [False, False, False, True]
    finally:
        for s, value in zip(setters, saved):
            s(value)


def test_the_output_fits_80_columns_and_wide_has_the_whole_table(capsys):
    six = ["digits", "--gpu", "h100", "--nproc", "8", "--nnodes", "2", "--price", "2.5"]  # six layouts
    text = _plan_text(six, capsys)
    assert _widest(text) <= 80, text
    header = next(line for line in text.splitlines() if line.startswith("layout"))
    assert header.split() == ["layout", "ddp", "ddp", "fsdp", "fsdp", "hsdp", "hsdp"]
    rows = {line.split()[0] for line in text.splitlines()}
    assert {"params", "grads", "optimizer", "activations", "total", "fits", "compute", "comm", "step", "run"} <= rows
    wide = _plan_text([*six, "--wide"], capsys)
    columns = ["layout", "checkpointing", "params", "grads", "optimizer", "activations", "fsdp buffers", "total",
               "fits", "compute", "comm", "run", "cost $"]
    head = next(line for line in wide.splitlines() if "┃" in line and "checkpointing" in line)
    assert [c.strip() for c in head.strip("┃").split("┃")] == columns
    assert len([line for line in wide.splitlines() if line.startswith("│")]) == 6 and _widest(wide) > 120


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "tpu"], ["--gpu = 'tpu'", "expected one of h100, h200", "fix: --gpu h100"]),
    (["--mfu", "0"], ["--mfu = '0'", "expected a number in (0, 1]", "fix: --mfu 0.4"]),
    (["--mfu", "1.5"], ["--mfu = '1.5'"]),
    (["--price", "free"], ["--price = 'free'", "fix: --price 2.5"]),
    (["--model.n_head=5"], ["model.n_head = 5", "a divisor of model.n_embd"]),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert main(["plan", "gpt-stdlib", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def _run_summary(run_dir, *, accelerator: str | None, mfu: float | None, planned: int, measured: int,
                 compile_ratio: float | None = None, bubble: float | None = None) -> str:
    """A finished run's summary.json as train/run.py writes it: its MFU and its plan_vs_actual record (and with
    ``bubble``, a pipelined run's pipeline record: the bubble's share of its steps)."""
    run_dir.mkdir(parents=True)
    record = {"layout": {"strategy": "ddp"}, "accelerator": accelerator,
              "predicted": {"activations_bytes": planned, "total_bytes": planned + 10**9,
                            **({"compile_ratio": compile_ratio} if compile_ratio is not None else {})},
              "actual": {"activations_bytes": measured}, "error": {}, "notes": []}
    summary = {"device": "cuda:0" if accelerator else "cpu", "plan_vs_actual": record,
               **({"mfu": mfu} if mfu is not None else {}),
               **({"pipeline": {"pp": 2, "bubble_formula": bubble}} if bubble is not None else {})}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return str(run_dir)


def test_calibrate_takes_the_runs_mfu_and_activations(tmp_path, capsys):
    """--calibrate RUN...: the median MFU of the runs made on this --gpu replaces the assumed one (an explicit
    --mfu still wins), and their measured / planned activations multiply the planned activations."""
    runs = [_run_summary(tmp_path / f"r{i}", accelerator="h100", mfu=m, planned=10**9, measured=int(r * 10**9))
            for i, (m, r) in enumerate([(0.30, 1.10), (0.36, 1.30), (0.33, 1.20)])]
    small = [f"--{k}={v}" for k, v in SMALL.items()]
    base = tmp_path / "base.json"
    cal = tmp_path / "cal.json"
    _plan_text(["gpt-stdlib", "--gpu", "h100", *small, "--json", str(base)], capsys)
    text = _plan_text(["gpt-stdlib", "--gpu", "h100", *small, "--json", str(cal), "--calibrate", *runs], capsys)
    assert "calibrated from 3 run(s): MFU 0.33 (the runs' steady state), activations x1.2 (measured / planned " \
        "eagerly)" in " ".join(text.split()), text
    a, b = json.loads(base.read_text()), json.loads(cal.read_text())
    assert b["mfu_assumed"] == pytest.approx(0.33) and a["mfu_assumed"] == 0.30  # the eager default on an h100
    for before, after in zip(a["layouts"], b["layouts"]):
        assert after["compute_s"] == pytest.approx(before["compute_s"] * 0.30 / 0.33)
        assert after["activations_bytes"] == pytest.approx(before["activations_bytes"] * 1.2, abs=2)
        assert after["params_bytes"] == before["params_bytes"]
    explicit = _plan_text(["gpt-stdlib", "--gpu", "h100", *small, "--mfu", "0.5", "--calibrate", *runs], capsys)
    assert "MFU 0.5 given (its own layout, whole steps)" in " ".join(explicit.split())
    # a pipelined run's MFU counts its bubble (a fifth of its steps here): the rate its GPUs computed at is
    # 0.24 / (1 - 1/5) = 0.30, which the planner then gives every layout its own bubble on top of
    piped = _run_summary(tmp_path / "pp", accelerator="h100", mfu=0.24, planned=10**9, measured=10**9, bubble=0.2)
    text = _plan_text(["gpt-stdlib", "--gpu", "h100", *small, "--calibrate", piped], capsys)
    assert "calibrated from 1 run(s): MFU 0.3 (the runs' steady state)" in " ".join(text.split()), text


def test_calibrating_with_a_compiled_run_replaces_compiles_ratio_and_does_not_multiply_it(tmp_path, capsys):
    """A compiled run records the compile ratio its plan used (0.5 here: eagerly 2 GB planned, 1 GB); measured
    1.2 GB is 0.6 of the eager plan, whatever ratio the catalog holds when the plan is made: the calibrated plan
    is the eager plan times 0.6, not the catalog's compiled plan times 1.2."""
    run = _run_summary(tmp_path / "r", accelerator="h100", mfu=0.4, planned=10**9, measured=int(1.2e9),
                       compile_ratio=0.5)
    small = [f"--{k}={v}" for k, v in SMALL.items()] + ["--model.loss=split", "--model.residual=fp32"]  # as compiled
    eager, cal = tmp_path / "eager.json", tmp_path / "cal.json"
    _plan_text(["gpt-stdlib", "--gpu", "h100", *small, "--json", str(eager)], capsys)
    text = _plan_text(["gpt-stdlib", "--gpu", "h100", *small, "--train.compile=true", "--json", str(cal),
                       "--calibrate", run], capsys)
    assert "activations x0.6 (measured / planned eagerly)" in " ".join(text.split()), text
    for before, after in zip(json.loads(eager.read_text())["layouts"], json.loads(cal.read_text())["layouts"]):
        assert after["activations_bytes"] == pytest.approx(before["activations_bytes"] * 0.6, rel=1e-6, abs=2)


@pytest.mark.parametrize("kind, words", [
    ("missing", ["--calibrate", "no ", "summary.json", "fix: give the run directory of a finished run"]),
    ("cpu", ["the run was made on cpu, the plan is for h100", "fix: calibrate with runs on h100"]),
    ("h200", ["the run was made on h200, the plan is for h100", "--gpu h200"]),
    ("broken", ["cannot be read", "fix:"]),
    ("none", ["has no plan_vs_actual", "fix: calibrate with runs of a built-in model"]),
    ("own", ["a run of a model of one's own: its MFU and activations are its model's",
             "fix: calibrate with runs of a built-in model"]),
])
def test_calibrate_refuses_runs_it_cannot_use_in_one_line(kind, words, tmp_path, capsys):
    run = tmp_path / "run"
    if kind in ("cpu", "h200"):
        _run_summary(run, accelerator=None if kind == "cpu" else "h200", mfu=None, planned=1, measured=1)
    elif kind == "broken":
        run.mkdir()
        (run / "summary.json").write_text("{not json")
    elif kind == "none":
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"steps": 10}))
    elif kind == "own":
        _run_summary(run, accelerator="h100", mfu=0.4, planned=1, measured=1)
        summary = json.loads((run / "summary.json").read_text())
        summary["plan_vs_actual"]["model"] = "own"
        (run / "summary.json").write_text(json.dumps(summary))
    assert main(["plan", "gpt-stdlib", "--gpu", "h100", "--calibrate", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


@pytest.mark.parametrize("unit, acts, batch, words", [
    (10e9, 5e9, 1, ["FSDP's working set, two blocks all-gathered and one block's gradients (80.00 GB)",
                    "FSDP's working set alone is the larger part", "fix: smaller blocks"]),
    (1e9, 62e9, 2, ["the activations of its batch of 2 (62.00 GB)", "(8.00 GB), 70.00 GB of 68.42 GB usable",
                    "the activations are the larger part",
                    "fix: --data.batch_size=1 with --train.accum_steps keeping the global batch, a shorter"]),
])
def test_a_model_no_number_of_gpus_holds_is_told_what_does_not_shrink(unit, acts, batch, words):
    """The 405B case: what stays per GPU however many share the model state (activations, FSDP's working set of
    a block: two all-gathered in bf16 and one's fp32 gradients, 8 bytes per parameter) is named, with the part
    that is larger, and more GPUs are not offered as the fix."""
    from scaletrain.plan.estimate import ModelFacts

    facts = ModelFacts(params=int(400e9), trainable=int(400e9), largest_unit=int(unit), units=126,
                       flops_per_sample=1e15, tokens_per_sample=8192,
                       activations={k: int(acts) for k in ("none", "full", "sharded-none", "sharded-full")})
    cfg = load("gpt-stdlib", cli_overrides={"data.batch_size": batch, "train.precision": "bf16-mixed",
                                            "dist.nproc": 8})
    plan = make_plan(cfg, facts, ACCELERATORS["h100"], total_steps=10, accum_steps=1, mfu=0.4,
                     net_bytes_per_s=50e9, price_per_gpu_hour=None)
    assert plan.choice is None and "even 65,536 GPUs would not hold it" in plan.reason
    assert "more GPUs" not in plan.reason and all(w in plan.reason for w in words), plan.reason


def test_the_default_mfu_is_the_nearest_measured_run_and_says_which(capsys):
    from scaletrain.plan.catalog import default_mfu

    assert default_mfu("h100", compiled=False, params=6.7e9)[0] == 0.30
    assert default_mfu("h200", compiled=True, params=124e6)[0] == 0.41
    assert default_mfu("h100", compiled=True, params=3e9)[0] == 0.50  # nearer 1B than 124M
    assert default_mfu("h100", compiled=True, params=300e6)[0] == 0.41
    assert default_mfu("h200", compiled=True, params=124e6, tokens=16 * 1024)[0] == 0.41
    assert default_mfu("h200", compiled=True, params=124e6, tokens=48 * 1024)[0] == 0.465  # nearer 64 than 16
    assert default_mfu("h200", compiled=True, params=1e9, tokens=64 * 1024)[0] == 0.50  # size first
    mfu, source = default_mfu("l4", compiled=True, params=1e9)
    assert mfu == 0.40 and source.startswith("not measured on l4") and "--calibrate" in source
    text = " ".join(_plan_text(["gpt-stdlib", "--gpu", "h100", "--train.compile=true",
                                *(f"--{k}={v}" for k, v in SMALL.items())], capsys).split())
    assert "MFU 0.41 assumed" in text and "MFU: the nearest measured run: GPT-2 124M through scaletrain train, " \
        "compiled" in text


@pytest.mark.parametrize("loss, whole, sharded", [("split", 0.55, 1.0), ("fused", 0.42, 0.86)])
def test_compiled_activations_are_the_eager_measurement_times_the_measured_ratio(loss, whole, sharded):
    """train.compile: the built-in GPT's activations are planned as the eager (fake-tensor) measurement times
    the ratio measured on a GPU for its compile scope (whole graph for DDP, block by block for FSDP) and loss,
    nearest in size, then the same model.bias (plan/catalog.py COMPILED_ACTIVATIONS; SMALL has biases: the
    124M one with biases whole, the ~1B one without block by block); split block by block was not measured:
    eager."""
    eager_cfg = load("gpt-stdlib", {**{k: str(v) for k, v in SMALL.items()}, "model.loss": loss})
    splits = build_splits(eager_cfg.data, eager_cfg.model)
    sample, target = splits.train[0][0], splits.train[0][1]
    eager = measure_model(eager_cfg, splits.task, splits.info, sample, target=target)
    compiled_cfg = load("gpt-stdlib", {**{k: str(v) for k, v in SMALL.items()}, "model.loss": loss,
                                       "train.compile": "true"})
    compiled = measure_model(compiled_cfg, splits.task, splits.info, sample, target=target)
    for key, value in eager.activations.items():
        ratio = sharded if key.startswith("sharded-") else whole
        assert compiled.activations[key] == round(value * ratio), key
    assert compiled.params == eager.params and compiled.flops_per_sample == eager.flops_per_sample


def test_fsdp_on_one_rank_is_planned_with_fsdps_activations_and_no_buffers():
    """--parallel.strategy=fsdp on one GPU still runs FSDP (bf16 parameters, compiled block by block), so its
    plan vs actual reads the FSDP measurement (an H200 run planned the DDP one: -14% peak); nothing is
    all-gathered at one rank, so no buffers."""
    facts = ModelFacts(params=1000, trainable=1000, largest_unit=100, units=10, flops_per_sample=1.0,
                       tokens_per_sample=0, activations={"none": 7000, "sharded-none": 5000})
    kw = {"precision": "bf16-mixed", "optimizer": "adamw"}
    assert layout_memory(facts, "ddp", "none", shard=1, **kw) == (4000, 4000, 8000, 7000, 0)
    assert layout_memory(facts, "fsdp", "none", shard=1, **kw) == (4000, 4000, 8000, 5000, 0)
    assert layout_memory(facts, "fsdp", "none", shard=2, **kw) == (2000, 2000, 4000, 5000, 100 * (2 * 2 + 4))
