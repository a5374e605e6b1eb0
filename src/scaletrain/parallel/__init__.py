"""One function per technique, composed by parallelize() in a fixed order (torchtitan's):

    resolve the strategy (auto: by memory) -> degrees -> mesh -> this rank's pipeline stage (pp > 1)
    -> apply_tp (tp > 1) -> apply_activation_checkpointing -> apply_compile
    -> apply_fsdp (fsdp, hsdp) | apply_ddp (ddp, world > 1; not under pp: the pipeline runner averages)

The three techniques that work per block (checkpointing, compile, FSDP) work on the same blocks, found once
by ``units.find_units`` (parallel.fsdp_units, a ``blocks`` ModuleList, transformers' ``_no_split_modules``,
the largest run of same-class layers). Checkpointing wraps each block's forward before compile, so compile
traces the checkpointed block. Compiling before wrapping lets DDP's gradient hooks and FSDP's hooks sit
outside the compiled blocks; a model with blocks is compiled block by block, so gradients of late blocks are
ready (and their all-reduce or reduce-scatter can start) while earlier blocks are still in backward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.batch import Batch
from scaletrain.config import MemoryConfig, ParallelConfig
from scaletrain.errors import ConfigError, UserError, few
from scaletrain.layout import Layout, check_layout, resolve_degrees, resolve_layout, virtual_stages
from scaletrain.observe.memory import (
    choose_strategy,
    default_loss,
    device_capacity_bytes,
    estimate_activation_bytes,
    estimate_model_state,
)
from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing
from scaletrain.parallel.mesh import build_mesh, dp_mesh
from scaletrain.parallel.pipeline import stage_parts
from scaletrain.parallel.units import Units, find_units, unit_warnings, units_line
from scaletrain.sharded import fsdp_class, has_dtensors, is_dtensor, is_fsdp

__all__ = ["Layout", "Units", "apply_activation_checkpointing", "apply_compile", "apply_ddp", "apply_fsdp",
           "apply_tp", "build_mesh", "check_layout", "compile_mode", "find_units", "fsdp_units", "gradient_sync",
           "gradient_twice", "has_dtensors", "is_fsdp", "mixed_precision_policy", "parallelize", "resolve_degrees",
           "resolve_layout", "resolve_strategy", "set_gradient_sync", "sharded_parts", "uncompiled", "units_line",
           "unsharded_gradients", "unused_parameters"]

log = logging.getLogger(__name__)

# FSDP2 and tensor parallelism are built on torch's DTensor, whose import costs ~0.5 s a process (sharded.py):
# imported where a run shards or splits, not by every run that imports this package.
_SHARDING = {"apply_fsdp": "fsdp", "fsdp_units": "fsdp", "mixed_precision_policy": "fsdp", "apply_tp": "tensor"}


def __getattr__(name: str) -> Any:
    if name in _SHARDING:
        import importlib

        return getattr(importlib.import_module(f"scaletrain.parallel.{_SHARDING[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply_compile(model: nn.Module, units: Units | None = None, *, whole: bool = False, mode: str = "default") -> None:
    """torch.compile in place (state_dict keys unchanged): the whole model as one graph with ``whole`` (an
    unsharded model: the embedding, the head and a loss the model computes fuse with the blocks; under DDP,
    dynamo's DDPOptimizer splits the graph at bucket boundaries so the all-reduce still overlaps backward),
    else block by block when there are blocks (``units``: find_units(model) unless given), as FSDP needs: its
    hooks sit between the blocks. ``mode``: torch.compile's (train.compile_mode)."""
    units = units if units is not None else find_units(model)
    how = "" if mode == "default" else f" (mode {mode})"
    if units.modules and not whole:
        for block in units:
            block.compile(mode=mode)
        log.info("compiled %s%s", units.describe(), how)
    else:
        model.compile(mode=mode)
        log.info("compiled the whole model%s", how)


def compile_mode(compiled: nn.Module) -> str:
    """The mode of what ``torch.compile(module, mode=...)`` returned, read back from its inductor options (the
    public get_compiler_config()): a model given compiled is compiled again as scaletrain does it, in its own
    mode. 'default' for another backend, whose options say nothing of a mode."""
    options = getattr(compiled, "get_compiler_config", lambda: None)() or {}
    tune, graphs = bool(options.get("max_autotune")), bool(options.get("triton.cudagraphs"))
    return {(True, True): "max-autotune", (True, False): "max-autotune-no-cudagraphs",
            (False, True): "reduce-overhead"}.get((tune, graphs), "default")


class ReplicatedModel(DDP):
    """torch's DistributedDataParallel, through which the model's own methods and attributes are reached as on the
    model itself (``model.generate(...)``, ``model.config``, ``model.save_pretrained(...)``), as they are under FSDP
    and on one process, where the model is called bare: a loop sampling from its model stopped under DDP only
    ("'DistributedDataParallel' object has no attribute 'generate'").

    A method is called as it is, outside DDP's forward, which holds collectives (a buffer broadcast, the buckets'
    rebuild): a save_pretrained() on rank 0 alone must not wait there for the others. Gradients from such a call
    would not be averaged, so a method that runs the model's forward with gradients (``model.loss(x, y)``) is one
    line instead of ranks drifting apart (Lightning Fabric warns of the same)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "forward") or name.startswith("_"):  # torch's probes of DDP's own stay DDP's
                raise
        inner = super().__getattr__("module")
        found = getattr(inner, name)
        if not (inspect.ismethod(found) and found.__self__ is inner):
            return found

        def refuse(*_: Any) -> None:
            if torch.is_grad_enabled():
                raise UserError(f"model.{name}() runs the model's forward with gradients outside DDP's forward, so "
                                "its gradients would not be averaged over the ranks; fix: call the model itself "
                                f"(loss = loss_fn(model(x), y)), or {name}() under torch.no_grad()")

        @functools.wraps(found)
        def outside_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return found(*args, **kwargs)
            handle = inner.register_forward_pre_hook(refuse)
            try:
                return found(*args, **kwargs)
            finally:
                handle.remove()

        return outside_forward


def apply_ddp(model: nn.Module, mesh: DeviceMesh | None, *, bucket_mb: float, find_unused: bool) -> DDP:
    """Replicate the model; gradients are averaged by bucketed all-reduce overlapping backward.

    Runs over the mesh's dp_replicate axis, or the default group (all ranks) when mesh is None."""
    ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    group = mesh.get_group("dp_replicate") if mesh is not None else None
    wrapped = ReplicatedModel(model, device_ids=ids, process_group=group, bucket_cap_mb=bucket_mb,
                  find_unused_parameters=find_unused, gradient_as_bucket_view=True)
    log.info("DDP: buckets of %.0f MB", bucket_mb)
    return wrapped


def uncompiled(model: nn.Module) -> tuple[nn.Module, str | None]:
    """(the module, its compile_mode) for what torch.compile(module, mode=...) returned, else (model, None):
    scaletrain compiles it itself as train.compile does (before DDP or FSDP wrap it), in that mode, and names its
    weights by the module's own names, not _orig_mod.*. A DistributedDataParallel or DataParallel wrapper a
    script made itself is taken off too: scaletrain wraps the module for the run's layout (DDP in DDP
    all-reduced every gradient twice; FSDP would shard the wrapper), and its weights keep their names, not
    module.*. (The wrapper left behind does nothing: its gradient hooks wait for its own forward.)"""
    mode = None
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        bare = getattr(model, "_orig_mod", None)
        if isinstance(bare, nn.Module) and type(model).__name__ == "OptimizedModule":
            model, mode = bare, compile_mode(model)
            continue
        return model, mode


def unused_parameters(err: RuntimeError, models: list[nn.Module], step: int) -> UserError | None:
    """DDP's error about parameters that got no gradient in a backward of ``step`` (raised at the next forward, a
    page of text) as one line naming them, or None for any other error. DDP numbers the parameters that require
    a gradient in the module's order, each once; with several DDP models (a GAN) the error does not say which
    one, so the names of each candidate are given."""
    text = str(err)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)  # the same on every rank: said once
    indices = [int(i) for i in found.group(1).split()] if found else []
    named = []
    for model in models:
        if isinstance(model, DDP):
            params = [name for name, p in model.module.named_parameters() if p.requires_grad]
            named.append(few([params[i] for i in indices if i < len(params)], 6))
    which = " or ".join(f"({n})" for n in named if n) or "(TORCH_DISTRIBUTED_DEBUG=DETAIL names them)"
    count = f"{len(indices)} parameter{'s' * (len(indices) != 1)}" if indices else "parameters"
    return UserError(f"parallel.find_unused = false: {count} of the model got no gradient in step {step} "
                     f"{which}, and DDP averages every parameter's gradient each step; fix: "
                     "--parallel.find_unused=true (DDP then looks for them every step, at a cost), or freeze them "
                     "(requires_grad_(False)) or take them out of the model")


def mixed_gradient_dtypes(err: AssertionError, precision: str) -> UserError | None:
    """FSDP2's assertion that a unit's gradients came in two dtypes, as one line, or None for any other error. A
    module that casts itself inside forward (transformers' Switch router: ``self.classifier.to(torch.float32)``)
    turns its gathered bf16 parameters back to float32 under a mixed-precision policy, and FSDP reduce-scatters
    a unit's gradients in one dtype."""
    if "expects uniform gradient dtype" not in str(err):
        return None
    return ConfigError("train.precision", precision, "a model whose forward computes with the parameters in the "
                       "dtype FSDP gathers them in (a module of this one casts itself to another inside forward, "
                       "as transformers' Switch router casts its classifier to float32, and FSDP got gradients of "
                       "two dtypes to reduce-scatter as one)",
                       "--train.precision=fp32, or --parallel.strategy=ddp (bf16-mixed is autocast there, which "
                       "such a module is written for)")


REENTRANT_FIX = ("fix: use_reentrant=False in your torch.utils.checkpoint calls (torch's advice; transformers: "
                 "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or "
                 "leave checkpointing to --memory.activation_checkpointing=full")


def gradient_twice(err: RuntimeError) -> UserError | None:
    """DDP's error for a parameter whose gradient arrived twice in one backward (a page of text), as one line,
    or None for any other error. A module run more than once a step inside torch.utils.checkpoint with
    use_reentrant=True does it: each reentrant backward hands DDP that module's gradients again."""
    if "Expected to mark a variable ready only once" not in str(err):
        return None
    return UserError("DDP: a parameter's gradient arrived twice in one backward, as it does for a module run more "
                     "than once a step (shared weights, a loop over one layer) inside torch.utils.checkpoint with "
                     f"use_reentrant=True; {REENTRANT_FIX}")


def unsharded_gradients(model: nn.Module) -> UserError | None:
    """Under FSDP, at an optimizer step: a UserError naming the sharded parameters whose gradient is a plain
    tensor, or None. FSDP2 reduce-scatters a unit's gradients into sharded ones (DTensors) after its backward; a
    unit run more than once a step inside torch.utils.checkpoint with use_reentrant=True gets its later runs'
    gradients outside that (torch 2.13: the unit left unsharded, its gradients plain and partial; the step would
    apply wrong ones). Read once, at the first step: host-side types, no sync."""
    plain = [name for name, p in model.named_parameters()  # (such a unit is left unsharded too: plain parameters)
             if p.grad is not None and not (is_dtensor(p) and is_dtensor(p.grad))]
    if not plain:
        return None
    owners = sorted({name.rsplit(".", 1)[0] if "." in name else "(root)" for name in plain})
    return UserError(f"parallel.strategy = fsdp: the gradients of {few(owners)} reached them outside FSDP's "
                     "reduce-scatter, as for a module run more than once a step (shared weights, a loop over one "
                     "layer) inside torch.utils.checkpoint with use_reentrant=True, which FSDP2 does not support: "
                     f"the step would apply wrong gradients; {REENTRANT_FIX}")


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within: backward synchronizes gradients across ranks only if ``enabled`` (off on accumulation
    micro-steps but the last). DDP: as no_sync(); FSDP2: set_requires_gradient_sync (gradients stay unsharded
    and local until the syncing micro-step reduce-scatters their sum)."""
    if enabled:
        yield
        return
    set_gradient_sync(model, False)
    try:
        yield
    finally:
        set_gradient_sync(model, True)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """From now on, whether backward synchronizes the gradients of ``model`` (DDP or FSDP2; others have nothing to
    synchronize): gradient_sync() for a forward and backward that no one block of code holds (a loop of one's own
    accumulating: session.Session._sync_or_not). DDP decides at its forward (the flag its no_sync() sets), FSDP2
    after the backward."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = enabled
    elif is_fsdp(model):
        model.set_requires_gradient_sync(enabled)  # type: ignore[operator]


def _stage_of(model: nn.Module, mesh: DeviceMesh, pp: int, virtual: int) -> nn.Module:
    """This rank's stage (``virtual`` > 1: stages) of a built-in GPT or Llama or a transformers causal LM laid out
    as Llama's, placed on ``mesh``, or a one-line ConfigError."""
    from scaletrain.models import GPT, Llama
    from scaletrain.parallel.pipeline import causal_lm_parts, rank_stages

    parts = None if isinstance(model, (GPT, Llama)) else causal_lm_parts(model)  # a transformers causal LM's
    if not isinstance(model, (GPT, Llama)) and parts is None:  # a model of the user's: nothing says where its stages are
        raise ConfigError("parallel.pp", pp, f"1 for a {type(model).__name__}: pipeline stages split the built-in "
                          "GPT and Llama (model.name=gpt or llama) and Hugging Face causal LMs laid out as Llama's "
                          "(model.embed_tokens, model.layers, model.norm, lm_head)", "--parallel.pp=1, and "
                          "--parallel.strategy=fsdp for a model that does not fit one device")
    blocks = len(model.blocks if isinstance(model, GPT) else model.layers if isinstance(model, Llama) else parts[1])
    if pp * virtual > blocks:  # a model built by the caller: its config was not checked before the workers
        raise ConfigError("parallel.pp", pp, f"at most the model's {blocks} blocks in {pp * virtual} stages (each "
                          "holds at least one)", f"--parallel.pp={max(1, blocks // virtual)}")
    if parts is not None:
        names = mesh.mesh_dim_names or ()
        if "tp" in names and mesh.size(names.index("tp")) > 1:
            raise ConfigError("parallel.tp", mesh.size(names.index("tp")), f"1 with parallel.pp > 1 for a "
                              f"{type(model).__name__}: its pipeline stages are not split by tensor parallelism",
                              "--parallel.tp=1 (pipeline and FSDP compose), or --parallel.pp=1 (tensor "
                              "parallelism by the model's own plan)")
        _check_causal_lm_split(model, pp, virtual)
    stage = rank_stages(model, pp, mesh.get_local_rank("pp"), virtual)
    stage.mesh = mesh
    return stage


def _check_causal_lm_split(model: nn.Module, pp: int, virtual: int) -> None:
    """A Hugging Face causal LM's stages (parallel/pipeline.py) run its layers as its own forward does only if
    its forward does no more than Llama's (no scaled embeddings, no padding mask, causal SDPA): the stages,
    chained on this rank, must give the logits the model gives for one short sequence, or it is one line."""
    from scaletrain.parallel.pipeline import split_stages

    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return
    device = params[0].device
    vocab = model.lm_head.out_features
    ids = (torch.arange(8, device=device) * 7 % vocab).unsqueeze(0)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=ids).logits.float()
            x = ids
            for stage in split_stages(model, pp * virtual):
                x = stage(x)
            got = x.float()
    finally:
        model.train(was)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        gap = (got - want).abs().max().item() if got.shape == want.shape else math.inf
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        why = f"its attention ({attn!r}) needs a causal mask, which the stages leave to SDPA" \
            if attn not in (None, "sdpa") else "its forward does more than Llama's between the layers"
        fix = "build it with attn_implementation='sdpa', or --parallel.pp=1" if attn not in (None, "sdpa") else \
            "--parallel.pp=1, and --parallel.strategy=fsdp for a model that does not fit one device"
        raise ConfigError("parallel.pp", pp, f"1 for this {type(model).__name__}: its layers run as pipeline stages "
                          f"do not give its own forward's logits (largest difference {gap:.3g}): {why}", fix)


def resolve_strategy(model: nn.Module, cfg: ParallelConfig, *, world_size: int, nnodes: int = 1,
                     precision: str = "fp32", optimizer: str = "adamw", sample: torch.Tensor | Batch | None = None,
                     batch_size: int = 1, cpu_offload: bool = False,
                     loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss) -> tuple[str, str]:
    """(strategy, reason): cfg.strategy as given, or for auto the memory rule's choice with its numbers.

    ``model`` is the bare model on its device; ``sample`` is one input (no batch dim) for measuring
    activations at ``batch_size`` per rank, backward from ``loss_fn(output, target)`` (fit()'s, or the default
    loss's cross-entropy). Every rank takes rank 0's decision, so they cannot disagree.
    """
    if cfg.strategy != "auto":
        return cfg.strategy, f"parallel.strategy={cfg.strategy}"
    if cpu_offload:
        choice = "hsdp" if nnodes > 1 else "fsdp"
        return choice, f"auto -> {choice}: memory.cpu_offload offloads sharded state, which needs FSDP"
    device = next(model.parameters()).device
    capacity = device_capacity_bytes(device, max(world_size // max(nnodes, 1), 1))
    note = ""
    try:
        acts = estimate_activation_bytes(model, sample.to(device), batch_size, precision=precision,
                                         loss_fn=loss_fn) \
            if sample is not None else 0
        note = "" if sample is not None else " (activations not measured: no sample input)"
    except torch.OutOfMemoryError:
        acts, note = capacity, " (measuring activations at batch 2 ran out of memory)"
    replica = estimate_model_state(model, optimizer).with_activations(acts)
    choice, reason = choose_strategy(replica, capacity, world_size=world_size, nnodes=nnodes)
    decision = [choice, reason + note]
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    return decision[0], decision[1]


def _sharding_keys(layout: Layout, cfg: ParallelConfig, precision: str, memory: MemoryConfig) -> dict[str, Any]:
    """What a model's FSDP sharding was made with and cannot change once made: the keys that set it."""
    return {"parallel.dp_replicate": layout.dp_replicate, "parallel.dp_shard": layout.dp_shard,
            "train.precision": precision, "parallel.reshard_after_forward": cfg.reshard_after_forward,
            "memory.cpu_offload": memory.cpu_offload, "parallel.fsdp_units": cfg.fsdp_units}


_SHARDED_WHERE = "an earlier fit() or session in this process, or the script's own fully_shard"


def sharded_parts(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules sharded by FSDP already ('' for the model itself); one line when some are
    and the model holding them is not (a new model around parts of one an earlier run sharded): FSDP shards a
    module once and runs its sharded parts from the model they were sharded in; outside it they failed with
    torch's "got mixed torch.Tensor and DTensor" at the first forward, or its AssertionError at fully_shard."""
    kind = fsdp_class()
    found = [name for name, m in model.named_modules() if isinstance(m, kind)] if kind else []
    if found and found[0] != "":
        shown = few([repr(name) for name in found], 3)
        its, them = (f"its submodule {shown} is", "it") if len(found) == 1 else (f"its submodules {shown} are", "them")
        raise UserError(f"model: {its} sharded by FSDP already ({_SHARDED_WHERE}) and the model holding {them} is "
                        "not; FSDP shards a module once, and runs its sharded parts from the model they were "
                        "sharded in; fix: give the whole model that was sharded, or build this one of modules not "
                        "sharded (an earlier run's whole weights are in RUN_DIR/model.safetensors)")
    return found


def _sharded_before(model: nn.Module, layout: Layout, cfg: ParallelConfig, precision: str,
                    memory: MemoryConfig) -> bool:
    """True when ``model`` comes sharded already, and its sharding is kept: an earlier fit() or session in this
    process sharded it (the same model trained on, as Lightning's trainer.fit twice) with the keys this run
    asks for, or the script called fully_shard on it itself. FSDP shards a module once (fully_shard again
    was an AssertionError); anything else is one line: a layout that does not shard, other keys than those
    it was sharded with, or sharded parts inside a model that is not (sharded_parts)."""
    if not sharded_parts(model):
        return False
    if not layout.sharded or layout.tp > 1 or layout.pp > 1:
        raise ConfigError("parallel.strategy", layout.strategy + (f" with tp={layout.tp}" if layout.tp > 1 else "")
                          + (f" with pp={layout.pp}" if layout.pp > 1 else ""),
                          f"fsdp: the model is sharded by FSDP already ({_SHARDED_WHERE})",
                          "--parallel.strategy=fsdp, which keeps its sharding, or a model built anew")
    made = getattr(model, "_scaletrain_sharding", None)
    if made is None:
        log.info("the model comes sharded by fully_shard: kept as given")
        return True
    for key, value in _sharding_keys(layout, cfg, precision, memory).items():
        if made[key] != value:
            shown = str(made[key]).lower() if isinstance(made[key], bool) else made[key]
            raise ConfigError(key, value, f"{made[key]!r}, as the model was sharded by an earlier run in this "
                              "process (FSDP shards a module once)", f"--{key}={shown}, or a model built anew")
    log.info("the model comes sharded by an earlier run in this process: its sharding is kept")
    return True


def parallelize(model: nn.Module, device: torch.device, world_size: int, cfg: ParallelConfig, *,
                compile: bool, compile_mode: str = "default", precision: str = "fp32", memory: MemoryConfig | None = None, nnodes: int = 1,
                optimizer: str = "adamw", sample: torch.Tensor | None = None,
                batch_size: int = 1, layout: Layout | None = None, loss_parallel: bool = False) -> nn.Module:
    """Returns the module that forward/backward go through: the DDP wrapper, or ``model`` itself (sharded in
    place under FSDP); with pp > 1 this rank's pipeline stage of ``model`` (parallel/pipeline.py; sharded in
    place under FSDP; its ``mesh`` set), which the caller keeps in place of the model. ``model`` is on ``device``. ``layout``: the run's Layout, resolved once by the caller
    (the trainer and a session do); without it, it is resolved here: ``sample`` (one input, no batch dim) and
    ``batch_size`` (per rank) let strategy=auto measure activations, ``optimizer`` names its per-parameter
    state. ``loss_parallel``: under tensor parallelism keep the logits split by vocabulary (parallel/tensor.py
    apply_tp; the loss then runs inside loss_context(model))."""
    memory = memory or MemoryConfig()
    if layout is None:
        strategy, reason = resolve_strategy(model, cfg, world_size=world_size, nnodes=nnodes, precision=precision,
                                            optimizer=optimizer, sample=sample, batch_size=batch_size,
                                            cpu_offload=memory.cpu_offload)
        if cfg.strategy == "auto":
            log.info("%s", reason)
        layout = resolve_layout(cfg, memory, world_size, nnodes, strategy=strategy)
    strategy, replicate, shard = layout.strategy, layout.dp_replicate, layout.dp_shard
    if strategy == "hsdp" and replicate == 1:
        log.warning("hsdp with dp_replicate = 1 is fsdp over %d ranks; set --parallel.dp_replicate to "
                    "replicate", shard)
    # DDP alone runs over the default group; sharding needs a mesh (HSDP its two axes), tensor parallelism its
    # "tp" axis. torchtitan's order: TP, then checkpointing, compile, and FSDP over the data-parallel axes.
    kept = _sharded_before(model, layout, cfg, precision, memory)  # before a stage or a split is cut from it
    mesh = build_mesh(device.type, layout) if layout.sharded or layout.tp > 1 or layout.pp > 1 else None
    sharding = layout.sharded and mesh is not None and not kept  # fully_shard will run below
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0] if sharding else []
    if scalars:  # fully_shard's ValueError, a traceback on every rank, came from inside FSDP's set-up
        raise ConfigError("parallel.strategy", strategy, f"a model without 0-dimensional parameters, which FSDP2 "
                          f"cannot shard (here: {few(scalars)}; a learned temperature such as CLIP's logit_scale "
                          "is one)", "--parallel.strategy=ddp, or make each a parameter of one element "
                          "(nn.Parameter(value.reshape(1))), which broadcasts as the scalar did")
    if layout.pp > 1:
        assert mesh is not None
        model = _stage_of(model, mesh, layout.pp, virtual_stages(cfg))
    if layout.tp > 1:
        assert mesh is not None
        from scaletrain.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    units = find_units(model, cfg.fsdp_units)
    sharded = mesh is not None and layout.sharded
    for line in unit_warnings(model, units, sharded=sharded, checkpointing=memory.activation_checkpointing):
        log.warning("%s", line)
    apply_activation_checkpointing(model, memory.activation_checkpointing, units)
    if compile:  # whole when nothing splits the model between its blocks
        apply_compile(model, units, whole=not layout.sharded and layout.tp * layout.pp == 1, mode=compile_mode)
    if layout.sharded:
        if mesh is None:
            ignored = " (memory.cpu_offload ignored)" if memory.cpu_offload else ""
            log.warning("%s on one process without a process group: nothing to shard, the model runs "
                        "unwrapped%s", strategy, ignored)
            return model
        if kept:
            return model
        from scaletrain.train.guard import sparse_gradient_modules

        sparse = sparse_gradient_modules(model)
        if sparse:
            raise ConfigError("parallel.strategy", strategy, f"a model without sparse gradients to shard ({', '.join(sparse)} "
                              "gives them, which FSDP cannot shard)", "--parallel.strategy=ddp, or sparse=False on "
                              "the embedding")
        from scaletrain.parallel.fsdp import apply_fsdp, mixed_precision_policy, reduce_unused

        policy = mixed_precision_policy(precision)
        parts = stage_parts(model)  # interleaved stages: each its own FSDP root (each runs on its own)
        for part in parts:
            apply_fsdp(part, dp_mesh(mesh), param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                       reshard_after_forward=cfg.reshard_after_forward, cpu_offload=memory.cpu_offload,
                       units=units if len(parts) == 1 else find_units(part, cfg.fsdp_units))
            part._scaletrain_sharding = _sharding_keys(layout, cfg, precision, memory)
        if cfg.find_unused and not reduce_unused(model):
            raise ConfigError("parallel.find_unused", True, f"false under {strategy} with torch {torch.__version__}, "
                              "whose FSDP cannot reduce-scatter zeros for the parameters a rank leaves without a "
                              "gradient", "--parallel.strategy=ddp --parallel.find_unused=true, or a torch whose "
                              "FSDPModule has set_reduce_scatter_unused_params")
        return model
    if layout.tp > 1 or layout.pp > 1:  # TP: one data-parallel rank (DDP x TP is refused); PP: the runner averages
        return model
    if replicate > 1:
        return apply_ddp(model, None, bucket_mb=cfg.bucket_mb, find_unused=cfg.find_unused)
    return model
