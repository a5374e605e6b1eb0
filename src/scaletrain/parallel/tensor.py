"""Tensor parallelism (Megatron-LM's split of a block's matrices) with sequence parallelism, through
torch.distributed.tensor.parallel, on a 1-D "tp" mesh (a sub-mesh of the run's DeviceMesh).

Per block of the built-in Llama (Shoeybi et al. 2019; Korthikanti et al. 2022 for the sequence-parallel
norms), torchtitan's plan:

- attention: the query, key and value projections split by output (ColwiseParallel: each rank computes
  n_head / tp query heads and n_kv_head / tp key/value heads), the output projection by input (RowwiseParallel):
  one all-reduce per attention, or with sequence parallelism one all-gather before and one reduce-scatter after.
- MLP: gate and up by output, down by input, the same pattern.
- the norms (and the residual stream between blocks) sequence-parallel: each rank holds T / tp positions of the
  residual, so the norms' activations are split too; the all-gather happens where the attention and MLP need
  the whole sequence.
- embedding split by vocabulary rows; the output head split by vocabulary columns. The trainer's own
  cross-entropy keeps its logits split (torch's loss_parallel: 1/tp of them per rank, parallel.loss_parallel);
  with a loss function of one's own they are gathered whole, so that it sees ordinary logits.

The built-in GPT: the same split of attention and MLP, its query, key and value (one fused matrix) split part by
part (FusedColwise); its layer norms whole on every rank, since its learned position embedding is added to the
whole sequence; the embedding and the head, tied, one DTensor split by vocabulary rows.

Numbers: the same math as one process up to the order of floating-point sums (tests: 5 AdamW steps within
1e-5). Every rank of a tensor-parallel group reads the same batch (Layout.dp_rank).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from scaletrain.errors import ConfigError
from scaletrain.layout import check_tp_split, check_whole_split

log = logging.getLogger(__name__)


def check_tp(model: nn.Module, tp: int) -> None:
    """The built model through layout.check_tp_split: its heads and MLP width, read from the modules a user's
    config cannot be trusted to describe."""
    from scaletrain.models import GPT, Llama
    from scaletrain.parallel.pipeline import is_stage

    if isinstance(model, Llama) or (is_stage(model) and hasattr(model, "layers")):  # a Llama or a stage of one
        first = _blocks(model)[0]
        heads = (("model.n_head", first.attention.n_head), ("model.n_kv_head", first.attention.n_kv_head))
        check_tp_split(tp, "llama", heads, hidden=first.feed_forward.w1.out_features)
    elif isinstance(model, GPT) or is_stage(model):  # a GPT or a stage of one
        first = model.blocks[0] if isinstance(model, GPT) else next(iter(model.blocks.values()))
        check_tp_split(tp, "gpt", (("model.n_head", first.attn.n_head),), hidden=first.mlp[0].out_features,
                       loss="fused" if getattr(model, "fused_loss", False) else "split")
    elif tp > 1 and (hf := _hf_plan(model)) is not None:  # a transformers model that states its own split
        _check_hf(model, hf[1], tp)
    elif tp > 1:  # a model of the user's (fit(), a session): nothing says how to split its matrices
        raise ConfigError("parallel.tp", tp, f"1 for a {type(model).__name__} (a model of yours): tensor parallelism "
                          "splits the built-in GPT and Llama (model.name=gpt or llama) and Hugging Face models "
                          "whose config has a base_model_tp_plan", "--parallel.tp=1, and --parallel.strategy=fsdp "
                          "for a model that does not fit one device")


class ReplicatedGradSummed(ParallelStyle):
    """transformers' "replicated_with_grad_allreduce": a module every rank holds whole but applies to its own
    heads only (Qwen3's and Gemma3's per-head query and key norms, after the split projections), so each rank's
    gradient is its heads' share: summed over the group in backward, one all-reduce of the weight's size."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        Replicated()._apply(module, device_mesh)
        group = device_mesh.get_group()

        def summed(grad: torch.Tensor) -> torch.Tensor:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            torch.distributed.all_reduce(local, group=group)
            return grad

        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(summed)
        return module


# A Hugging Face plan's styles (config.base_model_tp_plan), as torch's parallel styles: a matrix split by output
# (its input whole; "gather_output": its output all-gathered whole again) or by input (its output all-reduced;
# "split_input": a whole input sliced here, no communication), an embedding split by vocabulary rows, a module
# kept whole whose gradient is summed. transformers names others (packed, local, MoE experts) that are refused.
HF_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
             "colwise_gather_output": functools.partial(ColwiseParallel, output_layouts=Replicate()),
             "rowwise_split_input": functools.partial(RowwiseParallel, input_layouts=Replicate()),
             "embedding_rowwise": functools.partial(RowwiseParallel, input_layouts=Replicate()),  # whole token ids
             "replicated_with_grad_allreduce": ReplicatedGradSummed}


def _hf_plan(model: nn.Module) -> tuple[nn.Module, dict[str, str]] | None:
    """(the module its names start from, the plan) of a Hugging Face transformers model whose config says how to
    split it (config.base_model_tp_plan: module patterns such as "layers.*.self_attn.q_proj" -> "colwise", what
    transformers' own tensor parallelism reads); None for any other model."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    base = getattr(model, "base_model", None)
    if not plan or not isinstance(base, nn.Module):
        return None
    return base, dict(plan)


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")  # transformers' names


def _check_hf(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """A transformers model's plan in styles HF_STYLES knows, and its heads and MLP width divided whole."""
    name = type(model).__name__
    other = sorted({style for style in plan.values() if style not in HF_STYLES})
    if other:
        listed = " and ".join([", ".join(other[:-1]), other[-1]] if len(other) > 1 else other)
        raise ConfigError("parallel.tp", tp, f"1 for a {name}: its config's base_model_tp_plan splits modules as "
                          f"{listed}, which scaletrain does not apply (it applies "
                          f"{', '.join(HF_STYLES)})", "--parallel.tp=1, and --parallel.strategy=fsdp for a "
                          "model that does not fit one device")
    config = model.config  # type: ignore[union-attr]
    experts = next((n for key in _EXPERT_COUNTS if isinstance(n := getattr(config, key, None), int) and n > 1), 0)
    if experts and not any("expert" in pattern for pattern in plan):
        # transformers 5 plans a Mixtral's attention only: its experts stayed replicated DTensors, whose routing
        # (nonzero, grouped_mm) DTensor cannot run, a traceback at the first forward
        raise ConfigError("parallel.tp", tp, f"1 for a {name}: its config's base_model_tp_plan splits none of its "
                          f"{experts} experts, and a mixture of experts left whole routes its tokens by value, which "
                          "a tensor-parallel model cannot", "--parallel.tp=1, and --parallel.strategy=fsdp for a "
                          "model that does not fit one device")
    heads = getattr(config, "num_attention_heads", None)
    counts = (("num_attention_heads", heads), ("num_key_value_heads", getattr(config, "num_key_value_heads", heads)))
    width = getattr(config, "intermediate_size", None)
    check_whole_split(tp, tuple((f"the {name}'s {key}", n) for key, n in counts if isinstance(n, int)),
                      hidden=(f"the {name}'s intermediate_size = {width}", width) if isinstance(width, int) else None)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """A Llama's blocks, or a pipeline stage's (a ModuleDict by block index)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _quiet() -> None:
    """Two of torch's messages that every rank prints and that ask nothing of the user: DTensor's advice to
    flatten the mesh when a scalar (the gradient norm) or a checkpointed matrix is reduced over two axes one
    after the other (bytes, once per step or save), and FSDP2's caution that the tensor-parallel head returns
    a view (the trainer's losses do not write into it)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class FusedColwise(ParallelStyle):
    """Column parallelism for a Linear whose output is ``parts`` matrices stacked (GPT's fused query, key and
    value): each part is split over the ranks, so a rank's rows are [q_r; k_r; v_r] (DTensor's _StridedShard),
    not the r-th slice of the stack; its output, local, is this rank's heads of each part.

    The bias stays whole on every rank (Replicate) and each rank adds its own slice of each part. Split part by
    part as the weight is, FSDP's Shard(0) over it (the only dim of a 1-D tensor) would nest one strided split
    in another, which DTensor does not describe: training stayed right but full_tensor() and checkpoints
    gathered it out of order. A Replicate bias has no such split, and FSDP shards the weight by its other dim
    (fsdp_placement), so every placement says where the values are. The cost: the bias's gradient is
    all-gathered over the tp ranks in backward (3 x n_embd numbers per block)."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear), module
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh,
                                                       [_StridedShard(0, split_factor=self.parts)]))
        if module.bias is not None:
            module.bias = nn.Parameter(distribute_tensor(module.bias, device_mesh, [Replicate()]))
        module.forward = functools.partial(_fused_forward, module, device_mesh, self.parts)
        return module


def _fused_forward(module: nn.Linear, mesh: DeviceMesh, parts: int, x: torch.Tensor) -> torch.Tensor:
    """FusedColwise's forward: ``x`` (whole on every rank) through this rank's rows of the weight and its
    slices of the bias. x enters as a Replicate DTensor whose local gradient is partial, so its gradient is
    summed over the tp ranks in backward (as ColwiseParallel's input does)."""
    x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    bias = module.bias
    if bias is not None:  # (parts, n) whole -> (parts, n / tp) this rank's: a local slice; backward all-gathers
        bias = bias.view(parts, -1).redistribute(mesh, [Shard(1)]).to_local().reshape(-1)
    return nn.functional.linear(x, module.weight.to_local(), bias)


def fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's shard_placement_fn: a matrix split part by part over tp (FusedColwise) is sharded by FSDP along
    its input dim, so the two splits lie on different dims; every other parameter along dim 0 (None)."""
    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return None


class TiedColwise(ColwiseParallel):
    """ColwiseParallel for an output head whose weight is the token embedding's, split already (by rows, as
    the embedding's RowwiseParallel splits it: the same Shard(0)): the one DTensor stays shared."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        assert isinstance(module.weight, DTensor) and module.weight.placements == (Shard(0),)


class Replicated(ParallelStyle):
    """A module every rank computes whole (GPT's layer norms and position embedding, without sequence
    parallelism): its parameters Replicate DTensors, so their gradients (identical on every rank) are
    DTensors like the rest for clipping and DCP; inputs and outputs local tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, loss_parallel: bool = False) -> nn.Module:
    """Split ``model`` (a built-in GPT or Llama) in place over the 1-D ``mesh``; returns it (FSDP may shard it
    next: fsdp_placement). Parameters become DTensors on ``mesh`` (split or replicated):
    state_dict keys are unchanged, and DCP saves them whole-tensor-addressable, so a checkpoint resumes at
    another tp. ``loss_parallel``: the logits stay split by vocabulary (a DTensor, Shard(-1)), for a
    cross-entropy computed on the shards under loss_context(): 1/tp of the logits and of their gradient per
    rank instead of all of them; else they are gathered whole, for any loss function."""

    check_tp(model, mesh.size())
    _quiet()
    hf = _hf_plan(model)
    model.loss_parallel = loss_parallel and hf is None
    if hf is not None:  # its own plan (_hf_plan), applied by torch's parallelize_module: no sequence parallelism,
        base, plan = hf  # the embeddings and the head whole on every rank, its loss on whole logits
        parallelize_module(base, mesh, {pattern: HF_STYLES[style]() for pattern, style in plan.items()})
        _replicate_rest(model, mesh)
        log.info("tensor parallel: %s split %d ways by its config's base_model_tp_plan", type(model).__name__,
                 mesh.size())
        return model
    logits = {"output_layouts": Shard(-1), "use_local_output": False} if loss_parallel else \
        {"output_layouts": Replicate()}
    if hasattr(model, "blocks"):  # a GPT or a pipeline stage of one (a Llama's are its layers)
        return _apply_tp_gpt(model, mesh, logits)
    ends = {
        # Vocabulary rows split; the output is the residual stream, sequence-sharded from here on.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), **logits),
    }
    # A pipeline stage holds some of them; the residual stream it receives and sends is this rank's positions
    parallelize_module(model, mesh, {k: v for k, v in ends.items() if getattr(model, k, None) is not None})
    if getattr(model, "tok_embeddings", None) is not None:
        _grad_as_placed(model.tok_embeddings)
    if hasattr(model, "seq_shards"):
        model.seq_shards = mesh.size()
    for block in _blocks(model):
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    log.info("tensor parallel: %d blocks split %d ways (sequence-parallel norms)", len(_blocks(model)), mesh.size())
    return model


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter a plan left whole (embeddings, norms, the head) a Replicate DTensor, as Replicated() makes
    them, so that clipping and DCP see DTensors only (torch refuses a norm over a mix); a parameter two modules
    share (a head tied to the embedding) stays one parameter."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        whole = {k: p for k, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)}
        for key, param in whole.items():
            if id(param) not in made:
                made[id(param)] = nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]),
                                               requires_grad=param.requires_grad)
            module.register_parameter(key, made[id(param)])
        if whole:
            Replicated()._apply(module, mesh)  # its inputs made DTensors, its outputs local again


def _grad_as_placed(embedding: nn.Module) -> None:
    """Keep the embedding's weight gradient split as the weight is. Its backward under RowwiseParallel gives the
    gradient of the whole vocabulary, replicated, on every rank (torch's sharding rule for
    embedding_dense_backward), and autograd keeps it so: a Llama's rank held its full-vocabulary gradient, 1/tp
    of which it uses (2 GB per rank at 8B and tp 8; the planner counts 1/tp). A replicated gradient becomes
    this rank's rows by a local slice, before it is accumulated: no communication. The hook goes on the weight
    the forward uses (a model built on the meta device gets new parameters when it is given memory)."""
    hooked: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        weight = embedding.weight
        if isinstance(grad, DTensor) and isinstance(weight, DTensor) and grad.placements != weight.placements \
                and all(isinstance(p, Replicate) for p in grad.placements):
            return grad.redistribute(weight.device_mesh, weight.placements)
        return grad

    def before_forward(module: nn.Module, _: Any) -> None:
        if hooked != [id(module.weight)] and module.weight.requires_grad:
            module.weight.register_hook(hook)
            hooked[:] = [id(module.weight)]

    embedding.register_forward_pre_hook(before_forward)


def _apply_tp_gpt(model: nn.Module, mesh: DeviceMesh, logits: dict) -> nn.Module:
    """The built-in GPT: Megatron's split of attention (fused qkv by heads, FusedColwise) and MLP; the layer
    norms and the residual stream whole on every rank (no sequence parallelism: the learned position embedding
    is added to the token embedding's full sequence); the tied embedding and head split by vocabulary."""
    ends = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "pos_emb": Replicated(), "ln_f": Replicated()}
    # A pipeline stage holds some of them: the first the embeddings, the last ln_f and its own copy of the head
    parallelize_module(model, mesh, {k: v for k, v in ends.items() if getattr(model, k, None) is not None})
    head, emb = getattr(model, "head", None), getattr(model, "tok_emb", None)
    if head is not None and emb is not None:
        model.head.weight = model.tok_emb.weight  # the tie, now one DTensor split by vocabulary rows
        parallelize_module(model.head, mesh, TiedColwise(**logits))
    elif head is not None:  # the last stage's copy: split by the same rows as the first stage's embedding, so the
        parallelize_module(model.head, mesh, ColwiseParallel(**logits))  # two ends' shards sum rank by rank
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        parallelize_module(block, mesh, {
            "ln1": Replicated(),
            "attn.qkv": FusedColwise(3),
            "attn.proj": RowwiseParallel(),
            "ln2": Replicated(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        })
    log.info("tensor parallel: %d blocks split %d ways", len(model.blocks), mesh.size())
    return model
