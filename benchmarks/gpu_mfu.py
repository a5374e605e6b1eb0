"""Tokens/s, MFU and memory of scaletrain's GPT training on one GPU, in bf16 with torch.compile and SDPA.

Two shapes: GPT-2 124M (12 layers, 12 heads, 768 wide, 1024 tokens, vocab 50304 = 50257 padded to a multiple
of 128) trained as DDP would on one rank (bf16 autocast), and ~1B (18 layers, 16 heads, 2048 wide) trained
with FSDP2 on a 1-rank mesh (MixedPrecisionPolicy: bf16 parameters, fp32 gradient reduction). Data is random
tokens (throughput does not depend on the values). Everything is the library's own: models.GPT, the
parallel.apply_* functions, observe.memory.

MFU = achieved model FLOP/s / the device's peak dense bf16 FLOP/s. Model FLOPs per token are PaLM's count
(Chowdhery et al. 2022, appendix B; torchtitan's too): 6 N + 12 L H Q T, with N the parameters (the tied
head once, the position table left out), L layers, H heads, Q head size, T sequence length; the attention
term counts the full T x T scores although half are masked. Recomputation (activation checkpointing) is not
counted: MFU, not hardware FLOP utilisation. Peaks: H100 SXM and H200 989 TFLOP/s, H100 PCIe 756, A100 312.

    PYTHONPATH=src python benchmarks/gpu_mfu.py                    # both shapes, default settings
    PYTHONPATH=src python benchmarks/gpu_mfu.py --shape 124m --batch-size 32 --json out.json
    PYTHONPATH=src python benchmarks/gpu_mfu.py --smoke            # tiny shapes on the CPU, in seconds

Knobs that matter (see docs/fsdp.md for measured effects): the per-GPU batch (large enough to keep the
matmuls big: 124M wants >= 16 x 1024 tokens), torch.compile (fuses the layer norms, GELU, residual adds and
the loss), fused AdamW (one kernel for the whole update), TF32 for any fp32 matmul left, bias-free linears,
and for FSDP on one GPU reshard_after_forward=False (there is nothing to gather from; resharding only adds
copies). At 124M two more (benchmarks/RESULTS.md 5b): --residual bf16 (the residual stream in bf16, as under
FSDP's bf16 policy) and --loss fused (models.losses.linear_cross_entropy: the logits never read twice).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from scaletrain.models import GPT
from scaletrain.observe.memory import (
    estimate_activation_bytes,
    fmt_bytes,
    model_state_bytes,
    peak_bytes,
    reset_peak,
)
from scaletrain.parallel import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    build_mesh,
    mixed_precision_policy,
)

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched in order against the device
# name.
# (Belongs in the hardware catalog once plan/ has one.)
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]


# --sdpa: which attention kernels SDPA may pick from (auto: all, PyTorch chooses; on an H100 it chose cuDNN's).
SDPA = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_head: int
    n_embd: int
    seq: int
    vocab: int
    batch: int  # sequences per step (default; --batch-size overrides)
    fsdp: bool


SHAPES = {
    "124m": Shape(12, 12, 768, 1024, 50304, 64, fsdp=False),
    "1b": Shape(18, 16, 2048, 1024, 50304, 16, fsdp=True),
    "smoke": Shape(2, 2, 64, 64, 512, 2, fsdp=False),
    "smoke-fsdp": Shape(2, 2, 64, 64, 512, 2, fsdp=True),
}


def device_peak(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((peak for key, peak in PEAK_BF16 if key in name), None)


def join_one_rank_group(device: torch.device) -> None:
    """FSDP needs a process group even on one GPU: a 1-rank group over an in-process store."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def run_shape(name: str, shape: Shape, args: argparse.Namespace, device: torch.device) -> dict:
    batch = args.batch_size or shape.batch
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU directly: a 1B model's init on the CPU takes a while
        # The trainer's own model and knobs (model.bias, model.loss, model.residual): what is measured here is
        # what `scaletrain train` runs with the same keys.
        model = GPT(shape.vocab, shape.seq, shape.n_layer, shape.n_head, shape.n_embd, 0.0,
                    bias=not args.no_bias, fused_loss=args.loss == "fused", loss_chunk_rows=args.chunk_rows,
                    bf16_residual=not shape.fsdp and args.residual == "bf16")
    n_params = sum(p.numel() for p in model.parameters())
    apply_activation_checkpointing(model, args.ac)
    sample = torch.randint(0, shape.vocab, (shape.seq,), device=device)
    activations = estimate_activation_bytes(model, sample, batch, precision="bf16-mixed")  # eager, unwrapped
    step_model: torch.nn.Module = model
    autocast = not shape.fsdp
    if shape.fsdp:
        join_one_rank_group(device)
        if args.compile:
            apply_compile(model)  # per block, inside FSDP's hooks (torchtitan's order)
        policy = mixed_precision_policy("bf16-mixed")
        apply_fsdp(model, build_mesh(device.type, 1, 1), param_dtype=policy.param_dtype,
                   reduce_dtype=policy.reduce_dtype, reshard_after_forward=args.reshard)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if args.loss == "fused":  # the head and the loss in one pass per chunk; the logits never kept
            return step_model(x, y)["loss"]
        logits = step_model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    if args.compile and not shape.fsdp:
        loss_of = torch.compile(loss_of, mode=args.compile_mode)  # the whole model and the loss: one graph

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95),
                            fused=device.type == "cuda" and not args.no_fused)
    data = torch.randint(0, shape.vocab, (4, batch, shape.seq + 1), device=device)  # 4 batches in turn
    backend = SDPA[args.sdpa] if device.type == "cuda" else None
    state = None

    graphs = args.compile and args.compile_mode in ("reduce-overhead", "max-autotune")  # CUDA graphs

    def step(i: int) -> None:
        nonlocal state
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are free to reuse
        chunk = data[i % len(data)]
        x, y = chunk[:, :-1], chunk[:, 1:]
        attention = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast), attention:
            loss = loss_of(x, y)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        state = model_state_bytes(model, opt) if i == 0 else state  # counted once, gradients still held
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for i in range(args.warmup):  # compilation and allocator warm-up
        step(i)
    sync()
    warm_s = time.perf_counter() - t0
    if args.profile:
        _profile(step, sync, device)
    reset_peak(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i)
    sync()  # host-device sync: once, at the end of the timed steps
    elapsed = time.perf_counter() - t0

    tokens_per_s = args.steps * batch * shape.seq / elapsed
    flops_per_token = model.flops_per_sample() / shape.seq
    dev_name, peak = device_peak(device)
    peak_mem = peak_bytes(device)
    assert state is not None
    breakdown = state.with_activations(activations)
    return {
        "shape": name, "params": n_params, "n_layer": shape.n_layer, "n_head": shape.n_head,
        "n_embd": shape.n_embd, "seq_len": shape.seq, "vocab": shape.vocab, "batch": batch,
        "tokens_per_step": batch * shape.seq, "fsdp": shape.fsdp, "compile": args.compile,
        "compile_mode": args.compile_mode, "inductor": args.inductor, "sdpa": args.sdpa,
        "residual": "bf16" if shape.fsdp else args.residual, "loss": args.loss,
        "chunk_rows": args.chunk_rows if args.loss == "fused" else None,
        "activation_checkpointing": args.ac, "bias": not args.no_bias, "fused_adamw": not args.no_fused,
        "clip": args.clip, "warmup_steps": args.warmup, "timed_steps": args.steps, "warmup_s": warm_s,
        "step_s": elapsed / args.steps, "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token,
        "flops_per_s": tokens_per_s * flops_per_token, "device": dev_name, "peak_flops": peak,
        "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "peak_mem_bytes": peak_mem, "mem": breakdown.as_dict(),
        "activations_from_peak_bytes": peak_mem - state.model_state_bytes if device.type == "cuda" else None,
    }


def _profile(step: Callable[[int], None], sync: Callable[[], None], device: torch.device) -> None:
    """Where a step's time goes: torch.profiler over 3 steps, the top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(3):
            step(i)
        sync()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


def set_inductor(item: str) -> None:
    """KEY=VALUE -> torch._inductor.config.KEY = VALUE (a Python literal, else the string). The config module
    itself takes dotted keys (triton.cudagraphs) and refuses unknown ones."""
    from torch._inductor import config

    key, sep, text = item.partition("=")
    if not sep:
        raise ValueError(f"{item!r}: expected KEY=VALUE, e.g. coordinate_descent_tuning=True")
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = text.strip()
    try:
        setattr(config, key.strip(), value)
    except AttributeError:
        raise ValueError(f"{key.strip()!r} is not an inductor config key; see torch._inductor.config") from None


def report(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (peak unknown)"
    mem, rest = r["mem"], r["activations_from_peak_bytes"]
    how = "FSDP2 1-rank mesh" if r["fsdp"] else "autocast bf16"
    title = (f"{r['shape']}: {r['params'] / 1e6:.0f}M params, {r['n_layer']} layers x {r['n_embd']}, batch "
             f"{r['batch']} x {r['seq_len']}, {how}, compile={r['compile']}, "
             f"ac={r['activation_checkpointing']}, residual {r['residual']}, mode {r['compile_mode'] or 'default'}, "
             f"loss {r['loss']}"
             + "".join(f", {item}" for item in r["inductor"]))
    speed = (f"  {r['tokens_per_s']:,.0f} tokens/s  {r['step_s'] * 1e3:.1f} ms/step  "
             f"{r['flops_per_s'] / 1e12:.1f} TFLOP/s  MFU {mfu}  ({r['device']})")
    memory = (f"  peak memory {fmt_bytes(r['peak_mem_bytes'])}: params {fmt_bytes(mem['params_bytes'])} + "
              f"grads {fmt_bytes(mem['grads_bytes'])} + optimizer {fmt_bytes(mem['optim_bytes'])} + "
              f"activations {fmt_bytes(mem['activations_bytes'])} (measured eager, before compile)")
    if rest is not None:
        memory += f"; peak - model state = {fmt_bytes(rest)}"
    return f"{title}\n{speed}\n{memory}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["124m", "1b", "both"], default="both")
    ap.add_argument("--batch-size", type=int, default=0, help="sequences per step (0 = the shape's default)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config.KEY (e.g. coordinate_descent_tuning=True); repeatable")
    ap.add_argument("--residual", choices=["fp32", "bf16"], default="fp32",
                    help="the residual stream's dtype under autocast (FSDP's bf16 policy makes it bf16)")
    ap.add_argument("--loss", choices=["split", "fused"], default="split",
                    help="split: logits, then F.cross_entropy; fused: models.losses.linear_cross_entropy")
    ap.add_argument("--chunk-rows", type=int, default=8192, help="rows per chunk of the fused loss")
    ap.add_argument("--sdpa", choices=sorted(SDPA), default="auto", help="attention kernels SDPA may use")
    ap.add_argument("--ac", choices=["none", "full", "selective"], default="none")
    ap.add_argument("--reshard", action="store_true", help="FSDP reshard_after_forward (off: one GPU)")
    ap.add_argument("--no-bias", action="store_true", help="bias-free linears and layer norms")
    ap.add_argument("--no-fused", action="store_true", help="for-each AdamW instead of the fused kernel")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0 = off)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of 3 steps after warm-up")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: tests the script")
    args = ap.parse_args(argv)

    if args.smoke:
        names = ["smoke"] + ([] if args.loss == "fused" else ["smoke-fsdp"])
        args.compile, args.steps, args.warmup = False, 2, 1
    else:
        names = ["124m", "1b"] if args.shape == "both" else [args.shape]
    if args.loss == "fused" and any(SHAPES[n].fsdp for n in names):
        print("gpu_mfu: --loss fused calls the model's parts directly, past FSDP's hooks (the 1b shape is "
              "FSDP); fix: --shape 124m", file=sys.stderr)
        return 2
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device here; fix: run on a GPU machine, or --smoke to test the script",
              file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    try:
        for item in args.inductor:
            set_inductor(item)
    except ValueError as e:
        print(f"gpu_mfu: --inductor {e}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls left outside autocast use TF32
    torch.backends.cudnn.allow_tf32 = True

    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
              "command": " ".join(sys.argv)}
    print(" | ".join(f"{k} {v}" for k, v in header.items()))
    results = []
    try:
        for name in names:
            results.append(run_shape(name, SHAPES[name], args, device))
            print(report(results[-1]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**header, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
