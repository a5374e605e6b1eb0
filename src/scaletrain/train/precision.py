"""Mixed precision: bf16/fp16 compute with fp32 master weights, the fp16 gradient scaler, and TF32.

Without sharding, autocast casts matmul inputs in forward. Under FSDP2 the MixedPrecisionPolicy casts the
gathered parameters (parallel/fsdp.py); scaletrain's own models run without autocast then, a user's model with
it as well (policy_casts). train.tf32 decides
whether the fp32 matmuls and convolutions that remain (all of them in an fp32 run) use TF32 tensor cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from scaletrain.errors import ConfigError

DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def check_precision(precision: str, device: torch.device, strategy: str = "ddp") -> None:
    if precision == "fp16-mixed" and device.type != "cuda":
        raise ConfigError("train.precision", precision, "fp32 or bf16-mixed on a CPU (fp16 with loss scaling "
                          "needs CUDA)", "--train.precision=bf16-mixed")
    if precision == "fp16-mixed" and strategy in ("fsdp", "hsdp"):
        raise ConfigError("train.precision", precision, f"fp32 or bf16-mixed with parallel.strategy={strategy} "
                          "(fp16 loss scaling over sharded gradients is not supported here)",
                          "--train.precision=bf16-mixed (the same speed, no loss scaling needed)")


def slow_here(precision: str, device: torch.device) -> str:
    """Why ``precision`` would be slower than fp32 on this device ('' when it is not): bf16 autocast on a CPU
    without bf16 instructions (AVX512-BF16 or AMX) converts every matmul's operands in software."""
    if precision != "bf16-mixed" or device.type != "cpu":
        return ""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(probe is not None and probe() for probe in probes):
        return ""
    return ("train.precision = bf16-mixed on a CPU without bf16 instructions (no AVX512-BF16 or AMX): slower than "
            "fp32, not faster (20x for gpt-stdlib on a 2-core AVX2 VM); fix: --train.precision=fp32 on this machine")


def policy_casts(model: torch.nn.Module) -> bool:
    """True where FSDP's mixed-precision policy alone gives ``model`` the run's precision: sharded by fully_shard,
    and a model of scaletrain's own (``fsdp_policy_casts``: models/ and the pipeline's stages of them), written
    for it. A model of one's own gets autocast on top of the policy, as Lightning's and Accelerate's FSDP do: a
    float it makes inside (``mask.float()`` into a Linear) met bf16 weights ("mat1 and mat2 must have the same
    dtype"), and a loss it computes itself (Hugging Face's) was computed on bf16 logits, on fp32 under DDP."""
    from scaletrain.sharded import is_fsdp, stage_parts

    return is_fsdp(model) and all(getattr(part, "fsdp_policy_casts", False) for part in stage_parts(model))


def autocast(precision: str, device: torch.device, *, policy: bool = False) -> AbstractContextManager:
    """The forward-pass context: nothing for fp32 or where FSDP's policy casts alone (``policy``: policy_casts),
    else autocast."""
    if precision == "fp32" or policy:
        return contextlib.nullcontext()
    if device.type == "cpu":
        return _cpu_autocast(DTYPES[precision])
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


@contextlib.contextmanager
def _cpu_autocast(dtype: torch.dtype) -> Any:
    """torch.autocast on the CPU, with torch's fused attention fast path for inference (nn.MultiheadAttention,
    nn.TransformerEncoderLayer in eval under no_grad) turned off inside it: the path asks only whether CUDA's
    autocast is on, takes CPU autocast's bf16 for fp32 and stops ("expected scalar type Float but found BFloat16":
    an nn.TransformerEncoder's evaluation with a key padding mask, at step 0). Off, the layers run their ordinary
    modules, which autocast casts. Traced (a model the user compiled after set-up), the switch is left alone: it
    is no tensor op, and the graph would break there."""
    mha = None if torch.compiler.is_compiling() else getattr(torch.backends, "mha", None)
    was = mha.get_fastpath_enabled() if mha is not None else False
    if mha is not None:
        mha.set_fastpath_enabled(False)
    try:
        with torch.autocast(device_type="cpu", dtype=dtype):
            yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(was)


def autocast_forward(module: torch.nn.Module, context: Callable[[], AbstractContextManager]) -> None:
    """``module``'s forward, called outside an autocast, runs inside ``context()`` (the run's autocast) and
    returns its half-precision floating outputs as fp32, so a loss computed after it is computed in fp32, as
    it would be inside the autocast. Called inside one (``with st.autocast():``, the trainer's own step), it is
    the forward as it was: nothing converted."""
    forward = module.forward
    param = next(module.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled(device_type):
            return forward(*args, **kwargs)
        with context():
            return _to_fp32(forward(*args, **kwargs))

    module.forward = autocast_forward  # type: ignore[method-assign]


def _to_fp32(out: Any) -> Any:
    """bf16/fp16 tensors in ``out`` (a tensor, a tuple, a list, a dict or a dataclass) as fp32, ``out``'s own types
    kept (a ModelOutput updated in place, a namedtuple or a dataclass rebuilt) for the caller of the model's
    forward: batch.map_tensors gives plain dicts and tuples, which batches may be, but outputs read by attribute
    may not."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
    if isinstance(out, dict):
        for key, value in list(out.items()):
            converted = _to_fp32(value)
            if converted is not value:
                out[key] = converted
        return out
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        changed = {f.name: _to_fp32(getattr(out, f.name)) for f in dataclasses.fields(out) if f.init}
        return dataclasses.replace(out, **changed)
    if isinstance(out, tuple):
        items = [_to_fp32(v) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_to_fp32(v) for v in out]
    return out


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A scaler that is a no-op unless the run is fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16-mixed")


def set_tf32(on: bool, device: torch.device) -> None:
    """train.tf32 for this process: fp32 matmuls and cuDNN convolutions on TF32 tensor cores (10-bit mantissa,
    fp32's range), or full fp32. CUDA only: a CPU has no TF32 and its flags are left as they are."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


# train.attention -> the name in torch.backends.cuda.enable_<name>_sdp
_SDPA = {"flash": "flash", "cudnn": "cudnn", "efficient": "mem_efficient"}


def set_attention(choice: str, device: torch.device) -> None:
    """train.attention for this process: only the chosen scaled_dot_product_attention kernel, and math (the
    fallback PyTorch takes for inputs the kernel cannot take: fp32 under flash, say). ``auto`` leaves
    PyTorch's flags as they are (a user's own setting too), and so does a CPU, whose kernels these are not."""
    if device.type != "cuda" or choice == "auto":
        return
    for key, name in _SDPA.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(key == choice)
    torch.backends.cuda.enable_math_sdp(True)
