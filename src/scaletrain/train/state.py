"""The training state as plain trees, keyed by names rather than by object identity.

The model by parameter name (tied weights stored once, their aliases recorded), the optimizer by parameter
name rather than by its position in a param group (so a checkpoint does not depend on how the model was
wrapped or on the order of param groups), the LR schedule by its step. Everything returned here is a
reference to live tensors: the checkpointer copies what it keeps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from scaletrain.errors import CheckpointError
from scaletrain.sharded import is_dtensor, plain


def dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(unique tensors by name, {alias: name}): an alias is the same tensor object as an earlier name, or
    shares its storage, shape and strides (weight tying), so it is stored once."""
    unique: dict[str, torch.Tensor] = {}
    seen: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        keys = [("id", id(tensor))]
        if not is_dtensor(tensor) and tensor.numel():
            keys.append((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                         tensor.stride(), tensor.dtype))
        known = next((seen[k] for k in keys if k in seen), None)
        if known is not None:
            aliases[name] = known
            continue
        for k in keys:
            seen[k] = name
        unique[name] = tensor
    return unique, aliases


def tied(module: nn.Module) -> dict[str, str]:
    """{alias: name} for parameters registered under several names (weight tying), from the module itself:
    a gathered full state dict (FSDP) holds a separate copy per name, which dedupe() cannot tell apart."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def sorted_by_name(tree: dict[str, Any]) -> dict[str, Any]:
    """The same dict in sorted key order: the one order every process agrees on, whatever order a file or a
    gather produced (collectives issued per key must be issued in the same order on every rank)."""
    return {key: tree[key] for key in sorted(tree)}


def plain_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """A digest of every tensor of a sharded model's state that is not sharded: its buffers. FSDP does not
    synchronize buffers, so a rank's BatchNorm statistics are its own; compared across ranks, the digests
    say which buffers each rank must get back as it saved them."""
    digests = {}
    for name, tensor in state.items():
        if is_dtensor(tensor):
            continue
        t = tensor.detach().cpu().contiguous()
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy of them
        digests[name] = h.hexdigest()
    return digests


def differing(digests: list[dict[str, str]]) -> list[str]:
    """The names (sorted) whose digest is not the same on every rank holding them (a pipeline stage holds
    its own)."""
    return sorted(name for name in digests[0] if any(name in d and d[name] != digests[0][name] for d in digests[1:]))


def model_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """dedupe() of the module's state_dict."""
    return dedupe(module.state_dict())


def full_model_state(module: nn.Module, *, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights by name. Under FSDP every rank must call this (the shards are gathered);
    rank 0 gets host tensors, the others an empty dict."""
    if not sharded:
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def stages_state(stage: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The whole model's weights gathered on rank 0 from the stages of a pipeline (parallel/pipeline.py), each
    stage's whole (an FSDP stage's shards gathered first), and the names a stage's copy of a tied weight
    stands for ({alias: name}); empty on the other ranks. Every rank must call this."""
    copies = stage.tied_aliases
    local = {k: plain(v).detach().cpu()
             for k, v in stage.state_dict().items() if k not in copies}
    mesh = stage.mesh
    first = all(mesh.get_local_rank(n) == 0 for n in mesh.mesh_dim_names if n != "pp")  # one replica per stage
    sent = (local, copies) if first else ({}, {})
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, gathered, dst=0)
    if gathered is None:
        return {}, {}
    return ({k: v for tensors, _ in gathered for k, v in tensors.items()},
            {k: v for _, names in gathered for k, v in names.items()})


def stored_once(module: nn.Module, full: dict[str, torch.Tensor], *, sharded: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """dedupe() of ``module``'s whole weights ``full``; gathered from shards (FSDP), a tied weight's separate
    copies are folded into one as well (tied())."""
    tensors, aliases = dedupe(full)
    if sharded:
        for alias, name in tied(module).items():
            if alias in tensors and name in tensors:
                del tensors[alias]
                aliases[alias] = name
    return tensors, aliases


def with_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The inverse of dedupe(): every alias back, sharing its tensor."""
    return {**tensors, **{alias: tensors[name] for alias, name in aliases.items() if name in tensors}}


def load_model_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                       where: str) -> None:
    full = with_aliases(tensors, aliases)
    want = set(module.state_dict())
    if set(full) != want:
        missing, extra = sorted(want - set(full)), sorted(set(full) - want)
        raise CheckpointError(where, f"weights do not fit this model (missing {missing[:3]}, unexpected "
                              f"{extra[:3]})", "resume with the model configuration the checkpoint was made with")
    for name, value in module.state_dict().items():
        if tuple(value.shape) != tuple(full[name].shape):
            raise CheckpointError(where, f"{name} has shape {tuple(full[name].shape)} in the checkpoint, "
                                  f"{tuple(value.shape)} in this model", "resume with the same model configuration")
    module.load_state_dict(full, strict=True)


def _param_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The name of every parameter in the optimizer, in state_dict index order."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    assert not missing, f"optimizer holds parameters the module does not: indices {missing[:5]}"
    return [names[id(p)] for p in order]


def optimizer_tree(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    names = _param_names(module, optimizer)
    sd = optimizer.state_dict()
    return {"state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_optimizer_tree(module: nn.Module, optimizer: Optimizer, tree: dict[str, Any], where: str) -> None:
    names = _param_names(module, optimizer)
    index = {n: i for i, n in enumerate(names)}
    saved_groups = tree["param_groups"]
    live_groups = optimizer.state_dict()["param_groups"]
    shape_saved = [sorted(g["params"]) for g in saved_groups]
    shape_live = [sorted(names[i] for i in g["params"]) for g in live_groups]
    if shape_saved != shape_live:
        raise CheckpointError(where, "optimizer state does not fit this model's parameter groups",
                              "resume with the model and optimizer configuration the checkpoint was made with")
    groups = keep_implementation(saved_groups, optimizer)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    state = {index[n]: s for n, s in tree["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# How a step is computed, not what it computes: these follow the optimizer this run built (a checkpoint from an
# FSDP run, where fused SGD is unavailable, must not turn a DDP run's fused kernel off, and vice versa).
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def keep_implementation(saved_groups: list[dict[str, Any]],
                        optimizer: Optimizer | Sequence[Optimizer]) -> list[dict[str, Any]]:
    """The saved param groups with the live optimizer's implementation flags (several optimizers: their groups
    in order, as torch's optimizer state dicts of several list them). A key the saved group has and the live one
    not yet (``initial_lr``, which an LR scheduler adds once built) is given to the live group first: torch's
    distributed loader takes only the keys the live optimizer has."""
    live = [g for opt in ([optimizer] if isinstance(optimizer, Optimizer) else optimizer) for g in opt.param_groups]
    out = []
    for i, group in enumerate(saved_groups):
        group = dict(group)
        for key in IMPLEMENTATION:
            if i < len(live) and key in live[i]:
                group[key] = live[i][key]
        if i < len(live):
            for key, value in group.items():
                if key != "params" and key not in live[i]:
                    live[i][key] = value
        out.append(group)
    return out


def scheduler_tree(scheduler: LambdaLR) -> dict[str, Any]:
    """The schedule's position: the schedule itself is rebuilt from the config."""
    return {"last_epoch": scheduler.last_epoch, "step_count": scheduler._step_count,
            "base_lrs": list(scheduler.base_lrs), "last_lr": list(scheduler.get_last_lr())}


def load_scheduler_tree(scheduler: LambdaLR, optimizer: Optimizer, tree: dict[str, Any]) -> bool:
    """Continue the schedule at the saved step. Returns False when this run's peak lr differs from the saved
    one (another global batch under the linear scaling rule): the lr then follows this run's peak."""
    scheduler.last_epoch = int(tree["last_epoch"])
    scheduler._step_count = int(tree["step_count"])
    same_peak = [float(x) for x in tree["base_lrs"]] == [float(x) for x in scheduler.base_lrs]
    if same_peak:
        lrs = [float(x) for x in tree["last_lr"]]
    else:
        lrs = [base * lmbda(scheduler.last_epoch) for base, lmbda in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(optimizer.param_groups, scheduler.base_lrs, lrs):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = lrs
    return same_peak
