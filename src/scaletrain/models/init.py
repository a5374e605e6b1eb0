"""Initial weights that do not depend on where a model is built: each parameter is drawn from its own generator,
seeded by the model's seed and the parameter's name.

Why: a model too large for one device must not be built whole on one device (or in host memory) before it is
split. The built-in models are then built on the meta device (no memory), split (pipeline stage, tensor and FSDP
shards) and only then given memory and values: ``materialize``. Drawing every tensor from one global generator in
construction order would tie each value to everything built before it; a generator per name gives a rank exactly
the values one process's model has for the parameters it holds, whichever layout holds them. Sharded parameters
(DTensors) take their part of the full tensor, drawn one parameter at a time (the largest parameter is the most
memory this needs at once, on the host).

A model states its rules as ``init_rules``: {parameter name: Rule}, and its seed as ``init_seed``, drawn from the
global generator when it is built (one draw, so ``torch.manual_seed`` still decides the weights); a pipeline stage
or any module holding some of its parameters under the same names carries both over.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from scaletrain.sharded import is_dtensor, local_shard


@dataclass(frozen=True)
class Rule:
    kind: Literal["normal", "zeros", "ones"]
    std: float = 0.0


ZEROS, ONES = Rule("zeros"), Rule("ones")


def draw_seed() -> int:
    """The model's seed: one draw from the global CPU generator (explicitly on the CPU: under a meta-device
    context the draw is still real), so run.seed decides it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the planner builds models under fake tensors, where .item() has no value
        return int(torch.randint(0, 2**62, (), device="cpu").item())


@contextlib.contextmanager
def unfilled() -> Iterator[torch.device]:
    """Build layers on the meta device, yielding the device they were meant for (the ambient one): their own
    default initialisation, which init_params replaces, would cost time and random draws (leaving the global
    generator elsewhere on a meta-built model than on a real one). The caller then moves them with to_empty."""
    from torch._subclasses.fake_tensor import is_fake

    probe = torch.empty(0)
    if is_fake(probe):  # the planner's fake tensors already cost nothing (and cannot be swapped for meta ones)
        yield probe.device
        return
    with torch.device("meta"):
        yield probe.device


def place(module: nn.Module, device: torch.device) -> None:
    """After ``with unfilled() as device:``: give the layers memory on ``device`` (to_empty), unless there."""
    if any(p.device != device for p in module.parameters()):
        _to_empty(module, device)


def _to_empty(module: nn.Module, device: torch.device) -> None:
    """module.to_empty(device), its tied weights tied again: moving off the meta device makes new Parameters, one
    per module that held the shared one."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied weight: the same Parameter in several modules
    for mod in module.modules():
        for pname, param in mod.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod, pname))
    module.to_empty(device=device)
    for tied in (group for group in owners.values() if len(group) > 1):
        first = getattr(*tied[0])
        for mod, pname in tied[1:]:
            setattr(mod, pname, first)


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: stable across processes, Python versions and layouts."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def full_value(rule: Rule, shape: torch.Size, seed: int, name: str) -> torch.Tensor:
    """The whole parameter ``name`` (fp32, on the host) by ``rule``."""
    if rule.kind == "zeros":
        return torch.zeros(shape)
    if rule.kind == "ones":
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, rule.std, generator=generator)


def _own_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` this rank holds of ``param``: all of it, or its shard of a DTensor (sliced where it
    is, no communication: every rank drew the same full tensor)."""
    if not is_dtensor(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def init_params(module: nn.Module, rules: dict[str, Rule], seed: int, aliases: dict[str, str] | None = None) -> None:
    """Fill every parameter of ``module`` (its names are the model's) by its rule; ``aliases``: {a name here: the
    model's name whose values it takes} (a tied weight's copy on another pipeline stage). Meta parameters are
    skipped: a model built on the meta device gets its values in materialize()."""
    aliases = aliases or {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.is_meta:
                continue
            kept = aliases.get(name, name)
            if kept not in rules:
                raise KeyError(f"no initial-weight rule for parameter {kept!r}")
            full = full_value(rules[kept], param.shape, seed, kept)
            local = local_shard(param)
            local.copy_(_own_part(param, full.to(local.device)))


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def refuse_unfilled(module: nn.Module) -> None:
    """A one-line UserError for a model of the user's built on the meta device: its initialisation is its own
    (scaletrain fills only the built-in models', by their init_rules)."""
    if is_meta(module) and getattr(module, "init_rules", None) is None:
        from scaletrain.errors import UserError

        raise UserError(f"this {type(module).__name__}'s parameters are on the meta device (no values), and "
                        "scaletrain fills only its built-in models' weights; fix: build the model on the CPU (or "
                        "load its weights) before training it")


def refuse_sync_batchnorm(module: nn.Module, device: torch.device, world_size: int) -> None:
    """A one-line UserError for SyncBatchNorm layers in a multi-process run on a CPU: PyTorch syncs them on GPUs
    only (DDP raises 'SyncBatchNorm layers only work with GPU modules', a forward 'expected input tensor to be on
    GPU'), a traceback per rank. One process (nothing to sync) and GPUs run them."""
    if device.type != "cpu" or world_size < 2:
        return
    names = [name for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if names:
        from scaletrain.errors import UserError, few

        shown = few(names, 3)
        raise UserError(f"this {type(module).__name__} has SyncBatchNorm layers ({shown}), which PyTorch syncs on "
                        f"GPUs only, and this run is {world_size} processes on the CPU; fix: keep nn.BatchNorm on the "
                        "CPU (DDP gives every rank rank 0's running statistics) and call "
                        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) only when torch.cuda.is_available()")


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give a module built on the meta device (and split) memory on ``device`` and its initial weights: the
    model's own values, by name (``module.init_rules``/``init_seed``), and its computed buffers (``reset_buffers``)."""
    rules, seed = getattr(module, "init_rules", None), getattr(module, "init_seed", None)
    if rules is None or seed is None:
        raise ValueError(f"{type(module).__name__} was built on the meta device but states no init_rules/init_seed")
    _to_empty(module, device)
    init_params(module, rules, seed, getattr(module, "tied_aliases", None))
    reset = getattr(module, "reset_buffers", None)
    if callable(reset):
        reset(device)


def standard_rules(model: nn.Module, std: float = 0.02) -> dict[str, Rule]:
    """{name: Rule} for a transformer's parameters as GPT-2 and Llama initialise them: linear and embedding
    weights normal(0, ``std``), biases zero, norm weights one. Any other parameter is an error (a new module
    states its rule here first)."""
    rules: dict[str, Rule] = {}
    for prefix, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            if pname == "bias":
                rules[name] = ZEROS
            elif isinstance(mod, (nn.Linear, nn.Embedding)) and pname == "weight":
                rules[name] = Rule("normal", std)
            elif isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and pname == "weight":
                rules[name] = ONES
            else:
                raise ValueError(f"no initial-weight rule for {name} of a {type(mod).__name__}")
    return rules
