"""What the trainer needs of any batch and any model output: the model's inputs, the loss's target, the
logits and the loss, without assuming a tensor.

A loader may give a tensor, a tuple or list of any length, or a dict (Hugging Face's convention); a model may
return a tensor, a tuple, a dict or a dataclass-like output (transformers' ModelOutput). The convention,
unless ``batch_fn`` maps a batch to ``(inputs, target)`` itself:

- ``(x, y)``: ``model(x)``, target ``y``; ``(a, b, ..., y)``: ``model(a, b, ...)``, target ``y`` (the last);
  the target also goes to the model by name when its ``forward`` has a parameter named as a dict's target
  keys (below) that the inputs leave unfilled, as nanoGPT's ``forward(idx, targets=None)``: without its
  targets that model returns the last position's logits only (its generation path), not a training output;
- a tensor or ``(x,)``: ``model(x)``, no target (the model's output must then carry its own loss);
- a dict: ``model(**batch)`` with the keys its ``forward`` accepts (all of them if it takes ``**kwargs``), as
  Hugging Face's Trainer does; the target is the first of ``labels``, ``label``, ``targets``, ``target``,
  ``y`` present (also given to the model when its forward accepts it, so a transformers model computes its
  own loss).

``batch_fn(batch) -> (inputs, target)``: inputs a tensor (``model(inputs)``), a tuple (``model(*inputs)``)
or a dict (``model(**inputs)``).

This module sits at the bottom of the package (it imports only torch and errors): the loop, evaluation,
the FLOP counter and the memory measurements all read batches and outputs through it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError

BatchFn = Callable[[Any], tuple[Any, Any]]
TARGET_KEYS = ("labels", "label", "targets", "target", "y")
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index (and transformers' label padding)


def leaves(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a tensor, tuple/list, mapping (ModelOutput included) or dataclass, in order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, (tuple, list)):
        for value in tree:
            yield from leaves(value)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from leaves(getattr(tree, f.name))


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same structure (a tensor, mapping, list or tuple, nested) with ``fn`` applied to every tensor."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(map_tensors(v, fn) for v in tree)
    return tree


def to_device(tree: Any, device: torch.device) -> Any:
    """The same structure with every tensor moved to ``device`` (non-blocking; pinned memory makes it async)."""
    return map_tensors(tree, lambda t: t.to(device, non_blocking=True))


def _field(output: Any, name: str) -> Any:
    """``output.name`` or ``output[name]`` (a dataclass, a ModelOutput or a dict), None if absent."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def logits_of(output: Any) -> torch.Tensor | None:
    """The prediction tensor of a model output: the tensor itself, ``logits``, or a tuple's first tensor that is
    not a scalar (a scalar is a loss)."""
    if isinstance(output, torch.Tensor):
        return output
    found = _field(output, "logits")
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, (tuple, list)):  # the first that is not a scalar: (loss, logits) under return_dict=False
        return next((t for t in map(logits_of, output) if t is not None and t.dim() > 0), None)
    return None


def loss_of(output: Any, *, in_tuple: bool = False) -> torch.Tensor | None:
    """The loss a model computed itself (``output.loss`` / ``output["loss"]``, a scalar tensor; the output itself
    when it is one number), or None.

    ``in_tuple``: the model was given the targets (a ``targets``/``labels`` parameter of its forward), so a
    tuple it returns carries its loss as its first scalar (0-dim floating) item: nanoGPT's ``(logits, loss)``,
    transformers' ``(loss, logits, ...)`` under ``return_dict=False``. Without the targets a tuple's scalar is
    not the loss (an auxiliary loss beside the logits), so it is never taken for one."""
    if isinstance(output, torch.Tensor):  # one number: the loss (a VAE's, a contrastive model's), not logits
        return output if output.dim() == 0 and output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        if not in_tuple:
            return None
        return next((t for t in output if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()),
                    None)
    found = _field(output, "loss")
    return found if isinstance(found, torch.Tensor) and found.numel() == 1 else None


def default_loss(output: Any, target: Any, *, own_in_tuple: bool = False, reduction: str = "mean") -> torch.Tensor:
    """scaletrain's loss when the user gives none: the model's own loss when its output carries one (a
    transformers model given labels; with ``own_in_tuple``, a tuple's scalar: loss_of), else mean
    cross-entropy of the logits, (B, C) vs (B,) or (B, T, V) vs (B, T), ignoring target -100; float targets of
    the logits' shape are class probabilities (soft labels). ``reduction="sum"``: the cross-entropy's sum over
    the targets counted (train.loss_mean=tokens divides it by the step's count)."""
    own = loss_of(output, in_tuple=own_in_tuple)
    if own is not None:
        return own
    logits = logits_of(output)
    if isinstance(target, torch.Tensor) and logits is None:  # a tensor target, and nothing named logits
        fields = f" (fields: {', '.join(map(str, output))})" if isinstance(output, Mapping) else ""
        raise UserError(f"loss: the model returned {describe(output)}{fields} with no loss and no logits, so "
                        "scaletrain's cross-entropy cannot tell what to score; fix: pass loss_fn=lambda out, y: ... "
                        "(torchvision's segmentation models: F.cross_entropy(out['out'], y))")
    if not isinstance(target, torch.Tensor) or logits is None:
        what = "no target" if target is None else f"a target of type {type(target).__name__}"
        raise UserError(f"loss: the model returned {describe(output)} with no loss, and the batch has {what}; "
                        "fix: pass loss_fn=..., or batches (inputs, target) with a tensor target, or a batch_fn")
    soft = target.is_floating_point()
    if soft and (target.shape != logits.shape or logits.dim() < 2 or logits.shape[-1] == 1):
        # Class probabilities (soft labels) have the logits' shape, (B, classes); anything else is a regression
        # target (a model returning (B,) would make the whole batch one row of B "classes"), and a
        # cross-entropy over one class is 0 whatever the model does.
        raise UserError(f"loss: the targets are {str(target.dtype).removeprefix('torch.')} of shape "
                        f"{tuple(target.shape)} for logits of shape {tuple(logits.shape)}: not classes, and "
                        "scaletrain's default loss is cross-entropy over classes; fix: pass the loss, e.g. "
                        "loss_fn=torch.nn.functional.mse_loss for a regression")
    if not soft and logits.shape[:-1] != target.shape:  # shapes only: no sync
        raise UserError(f"loss: the model returned logits of shape {tuple(logits.shape)} for class targets of "
                        f"shape {tuple(target.shape)}; cross-entropy needs logits (*target's shape, classes); "
                        "fix: return logits for every target position, or pass loss_fn=..., or a batch_fn")
    classes = logits.shape[-1]
    if not soft and target.dtype != torch.long:
        target = target.long()  # int32 or uint8 class ids (numpy's int32, a pandas column): cross_entropy takes int64
    try:
        return F.cross_entropy(loss_logits(logits).reshape(-1, classes),
                               target.reshape(-1, classes) if soft else target.reshape(-1), reduction=reduction)
    except IndexError as err:  # a class id outside the logits (on a CPU: on a GPU it is a device-side assert)
        raise UserError(f"loss: {err} ({classes} logits: class targets are 0..{classes - 1}, or {IGNORE_INDEX} to "
                        f"ignore a position); fix: a model with one output per class, or targets in "
                        f"0..{classes - 1}") from None


def aligned(logits: torch.Tensor, target: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence logits (B, T, V) and targets (B, T) as a loss pairs them: position t against target t + ``shift``
    (1: a causal LM's next token, as transformers shifts the labels it is given)."""
    return logits[:, :logits.shape[1] - shift], target[:, shift:]


def shifted_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` on logits (B, T, V) predicting the next position (aligned, shift 1), as a transformers causal
    LM's own loss shifts the labels it is given (a pipeline's last stage returns logits)."""
    def shifted(logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return loss_fn(*aligned(logits, labels, 1), **kwargs)
    return shifted


def label_shift(output: Any, target: Any, loss: torch.Tensor | None) -> int | None:
    """How a loss computed elsewhere (a model's own, a loss_fn of the user's) lines up sequence logits (B, T, V)
    with class targets (B, T) (``aligned``): 0 when it scores position t against target t (token classification,
    nanoGPT's pre-shifted targets), 1 when against target t + 1 (a transformers causal LM), None when neither
    cross-entropy is that loss (label smoothing, a weighted loss: no accuracy can be said to match it). Read once,
    on the first training sample's output: the loss found must equal one alignment's cross-entropy to 1e-4 and lie
    ten times nearer it than the other's (an untrained model's near-uniform logits score both alike)."""
    logits = logits_of(output)
    if loss is None or loss.numel() != 1 or logits is None or logits.device.type == "meta" \
            or not isinstance(target, torch.Tensor) or target.is_floating_point() or target.dtype == torch.bool \
            or target.dim() < 2 or target.shape[1] < 2 or logits.shape[:-1] != target.shape:
        return None
    said, scores = float(loss.detach().float()), []
    with torch.no_grad():
        for shift in (0, 1):
            scored, kept = aligned(logits.detach().float(), target, shift)
            if not (kept != IGNORE_INDEX).any():
                return None
            ce = F.cross_entropy(scored.flatten(0, -2), kept.flatten(), ignore_index=IGNORE_INDEX)
            scores.append(abs(float(ce) - said))
    best = min((0, 1), key=lambda k: scores[k])
    near, other = scores[best], scores[1 - best]
    return best if near <= 1e-4 * max(1.0, abs(said)) and other > 10 * near else None


def check_targets(output: Any, target: Any, *, own_in_tuple: bool = False,
                  targets: torch.Tensor | None = None) -> None:
    """Before the first step, on the first training sample's output and target (host values: one look, no
    sync in the loop), what default_loss cannot see from shapes: float targets of the logits' shape must be
    class probabilities (multi-hot labels want a binary cross-entropy), and class ids must fit the logits.
    ``targets``: every training target, where the data are tensors in memory (checked whole, once)."""
    logits = logits_of(output)
    if loss_of(output, in_tuple=own_in_tuple) is not None or logits is None or not isinstance(target, torch.Tensor) \
            or logits.device.type == "meta" or logits.dim() < 2:
        return
    if target.is_floating_point():
        rows = target.detach().float().cpu().reshape(-1, target.shape[-1]) if target.dim() else None
        if rows is None or rows.shape[-1] != logits.shape[-1]:
            return  # not soft labels: default_loss names the shapes
        if (rows < 0).any() or not torch.allclose(rows.sum(-1), torch.ones(len(rows)), atol=1e-3):
            raise UserError(f"loss: the float targets are not class probabilities (the first sample's are "
                            f"{_short(rows[0])}: they sum to {rows[0].sum().item():.4g}), and scaletrain's default loss "
                            "is cross-entropy over classes; fix: pass the loss, e.g. loss_fn=torch.nn.functional."
                            "binary_cross_entropy_with_logits for multi-label targets, mse_loss for a regression")
        return
    if target.dtype == torch.bool or target.is_complex():
        return
    classes = logits.shape[-1]
    ids = (targets if targets is not None and not targets.is_floating_point() else target).detach().cpu()
    bad = ids[(ids != IGNORE_INDEX) & ((ids < 0) | (ids >= classes))]
    if bad.numel():
        top = int(ids.max())
        raise UserError(f"loss: class target {int(bad[0])} for logits of {classes} classes (targets are "
                        f"0..{classes - 1}, or {IGNORE_INDEX} to ignore a position); fix: a model with one output per "
                        f"class ({max(top + 1, classes)} here), or targets in 0..{classes - 1}")


def _short(row: torch.Tensor) -> str:
    values = ", ".join(f"{v:.3g}" for v in row[:6].tolist())
    return f"[{values}{', ...' if len(row) > 6 else ''}]"


def loss_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits a cross-entropy takes: bf16/fp16 ones upcast to fp32 first, as torchtitan, Megatron-LM and
    transformers compute their losses (a log-softmax over a large vocabulary in bf16 keeps 3 significant digits).
    Under autocast the cross-entropy upcast them anyway; under FSDP's bf16 policy (no autocast) nothing did, so
    the same run's loss was less precise under FSDP than under DDP. The fp32 copy and log-softmax cost memory
    (plan counts them: observe/memory.py measures with this loss); a compiled loss fuses them."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def describe(output: Any) -> str:
    """A short name for a model output, for messages."""
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, (tuple, list)) and output:
        return f"{_a(type(output).__name__)} of {len(output)} ({describe(output[0])}, ...)"
    return _a(type(output).__name__)


def _a(noun: str) -> str:
    """'a dict', 'an OrderedDict'."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def backward_scalar(output: Any) -> torch.Tensor:
    """A scalar whose backward reaches every differentiable tensor of ``output`` (for counting FLOPs and
    measuring memory of a whole step without knowing the loss)."""
    own = loss_of(output)
    if own is not None:
        return own
    parts = [t.float().sum() for t in leaves(output) if t.requires_grad]
    if not parts:
        raise UserError(f"model: its output ({describe(output)}) holds no tensor that requires grad; fix: "
                        "return the tensors computed from the parameters (logits or a loss)")
    return torch.stack(parts).sum()


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the model and the loss take it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any  # the loss's second argument; None when the batch has none
    # For a batch of one whose copies do not stack (a list of images per batch, as torchvision's detection
    # models take, or a field the collate_fn gives once per batch): n copies of the sample as the loader
    # collates them (one_sample()).
    grow: Callable[[int], Batch] | None = dataclasses.field(default=None, compare=False, repr=False)
    # Its first input is a list with an item per sample (torchvision's detection models' images), as the loader
    # collates it (one_sample() tells, Batcher.listed carries it to every batch).
    listed: bool = dataclasses.field(default=False, compare=False)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], *, target: bool = True) -> Batch:
        """The same batch with ``fn`` applied to every tensor of its inputs (and of its target, with ``target``)."""
        grow = self.grow
        return Batch(map_tensors(self.args, fn), map_tensors(self.kwargs, fn),
                     map_tensors(self.target, fn) if target else self.target,
                     None if grow is None else lambda n: grow(n).map(fn, target=target), self.listed)

    def to(self, device: torch.device) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=True))

    def __call__(self, model: nn.Module, **extra: Any) -> Any:
        """The model's forward on this batch (``extra``: more keyword arguments, transformers' num_items_in_batch)."""
        return model(*self.args, **self.kwargs, **extra)

    def pipeline_inputs(self) -> torch.Tensor:
        """What a pipeline's first stage takes: the one positional input, or transformers' ``input_ids`` (the
        target, ``labels``, goes to the last stage). Anything else the model would be given (an attention mask,
        a second input) is one line: the stages run one tensor through, over whole sequences."""
        given = [k for k, v in self.kwargs.items() if k != "input_ids" and v is not self.target]
        if len(self.args) + ("input_ids" in self.kwargs) != 1 or given:
            what = ", ".join([*(["input_ids"] if "input_ids" in self.kwargs else []), *given]) or \
                f"{len(self.args)} positional inputs"
            raise UserError(f"parallel.pp: the pipeline's first stage takes one input (token ids), and this batch "
                            f"gives the model {what}; fix: batches of input_ids and labels only (a causal mask is "
                            "applied; pad with labels -100 instead of an attention_mask), or --parallel.pp=1")
        return self.args[0] if self.args else self.kwargs["input_ids"]

    def counted(self) -> torch.Tensor:
        """The targets a cross-entropy counts (class ids other than -100), as a float tensor on their device."""
        return (self.target != IGNORE_INDEX).sum().float()

    def target_given(self) -> bool:
        """Whether the model is given the target too (by name: nanoGPT's ``targets``, transformers' ``labels``),
        so it can compute its own loss."""
        given = [*self.kwargs.values(), *(v for a in self.args if isinstance(a, Mapping) for v in a.values())]
        return self.target is not None and any(v is self.target for v in given)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the batch, inputs then target (for fingerprints)."""
        yield from leaves(self.args)
        yield from leaves(self.kwargs)
        yield from leaves(self.target)

    def size(self) -> int:
        """Samples in the batch: the length of its first input when that is a list of an item per sample
        (``listed``: torchvision's detection models take a list of images), else the leading dimension of its
        first input tensor."""
        if self.listed:
            return len(_first_input(self))
        first = next((t for t in leaves((self.args, self.kwargs)) if t.dim() > 0), None)
        return int(first.shape[0]) if first is not None else 1

    def repeat(self, n: int) -> Batch:
        """A batch of ``n`` copies of this batch of one (for memory measurements at a batch size)."""
        if self.grow is not None:
            return self.grow(n)

        def rep(tree: Any) -> Any:
            if isinstance(tree, torch.Tensor):
                return tree.expand(n, *tree.shape[1:]).contiguous() if tree.dim() > 0 else tree
            if isinstance(tree, Mapping):
                return {k: rep(v) for k, v in tree.items()}
            if isinstance(tree, (tuple, list)):
                return tuple(rep(v) for v in tree)
            return tree

        return Batch(rep(self.args), rep(self.kwargs), rep(self.target))

    def tokens_per_sample(self) -> int:
        """Tokens per sample when the model reads token ids (an integer tensor of shape (B, T, ...): the first
        positional input, or ``input_ids``), else 0."""
        ids = self.kwargs.get("input_ids", self.args[0] if self.args else None)
        return _tokens(ids.get("input_ids") if isinstance(ids, Mapping) else ids)


def _tokens(ids: Any) -> int:
    """Tokens per sample of ``ids`` when it is a batch of token ids (an integer tensor (B, T, ...)), else 0."""
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and not ids.is_floating_point() \
            and not ids.is_complex() and ids.dtype != torch.bool:
        return int(ids[0].numel())
    return 0


def tokens_per_sample(batch: Any) -> int:
    """Tokens per sample of a batch as a loader collates it (a tensor, a tuple whose first item is the input,
    or a dict with ``input_ids``): Batch.tokens_per_sample's rule, before any model splits it."""
    if isinstance(batch, Mapping):
        return _tokens(batch.get("input_ids"))
    if isinstance(batch, (tuple, list)):
        return _tokens(batch[0]) if batch else 0
    return _tokens(batch)


def _forward_params(module: nn.Module) -> list[inspect.Parameter] | None:
    """The parameters of ``module.forward``; None for a builtin or C forward (no signature to read)."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _takes_the_batch(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes a whole batch dict as its one argument: one parameter without a default
    (others may have defaults, none is *args or **kwargs), named ``batch`` or annotated as a dict or Mapping."""
    params = _forward_params(module) or []
    required = [p for p in params if p.default is p.empty]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or len(required) != 1 \
            or required[0].kind == required[0].KEYWORD_ONLY:
        return False
    one = required[0]
    return one.name == "batch" or any(word in str(one.annotation) for word in ("dict", "Dict", "Mapping"))


def _accepted(module: nn.Module) -> tuple[frozenset[str], bool, dict[str, int]]:
    """The keyword names ``module.forward`` accepts, whether it takes ``**kwargs``, and where each target
    name it has (TARGET_KEYS) sits among its positional parameters (a keyword-only one: never filled by
    position)."""
    params = _forward_params(module)
    if params is None:  # no signature to read: pass everything
        return frozenset(), True, {}
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        targets = {}  # *args would take a target given by position first: leave such a forward alone
    else:
        targets = {p.name: i for i, p in enumerate(positional) if p.name in TARGET_KEYS
                   and p.kind == p.POSITIONAL_OR_KEYWORD}
        targets |= {p.name: len(params) for p in params if p.kind == p.KEYWORD_ONLY and p.name in TARGET_KEYS}
    return named, any(p.kind == p.VAR_KEYWORD for p in params), targets


class Batcher:
    """Splits the loader's batches by the convention above (or by ``batch_fn``) for one model."""

    def __init__(self, module: nn.Module, batch_fn: BatchFn | None = None, *, target_kwarg: str | None = None) -> None:
        """``target_kwarg``: also pass the target to the model under this keyword (a model that computes its loss
        in forward, as the built-in GPT with model.loss=fused does); the loss's target stays the same."""
        self.batch_fn = batch_fn
        self.target_kwarg = target_kwarg
        self.names, self.any_name, self.target_params = _accepted(module)
        self.whole = _takes_the_batch(module)
        self.model_name, self.said_left_out = type(module).__name__.removeprefix("FSDP"), False
        self.listed = False  # the first input a list of an item per sample (one_sample() tells)

    def _inputs(self, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if isinstance(inputs, Mapping):
            return ((inputs,), {}) if self._as_one(inputs) else ((), self._keep(inputs))
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs), {}
        return (inputs,), {}

    def _as_one(self, batch: Mapping[str, Any]) -> bool:
        """Whether the whole dict goes to forward as its one argument: a forward(batch) (Lightning's way, or one
        annotated as taking a dict) that names none of its keys."""
        return self.whole and not any(k in self.names for k in batch)

    def _keep(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self.any_name:
            # A forward with **kwargs (Hugging Face's) takes any key, and a field that is no tensor (a list of
            # string ids, a dataset's text column) reached it and failed deep inside; such a field is left out
            # unless forward names it, as Hugging Face's Trainer leaves out the columns its model does not name.
            kept = {k: v for k, v in batch.items() if k in self.names or isinstance(v, torch.Tensor)}
            if len(kept) < len(batch) and not self.said_left_out:
                self.said_left_out = True
                left = ", ".join(f"{k!r} ({type(v).__name__})" for k, v in batch.items() if k not in kept)
                logging.getLogger("scaletrain").warning(
                    "data: %s in the batch: not a tensor, and %s.forward does not name it: left out of the model's "
                    "inputs", left, self.model_name)
            return kept
        kept = {k: v for k, v in batch.items() if k in self.names}
        if not kept:
            raise UserError(f"data: a batch with keys {sorted(batch)} has none that the model's forward takes "
                            f"({', '.join(sorted(self.names)) or 'no named arguments'}); fix: name the keys after "
                            "forward's arguments, or pass batch_fn=lambda b: (inputs, target) (a forward that "
                            "takes the whole dict: batch_fn=lambda b: ((b,), None), or name its argument batch)")
        return kept

    def __call__(self, batch: Any) -> Batch:
        split = self._split(batch)
        if self.target_kwarg is not None and split.target is not None:
            split = Batch(split.args, {**split.kwargs, self.target_kwarg: split.target}, split.target)
        return dataclasses.replace(split, listed=True) if self.listed else split

    def _split(self, batch: Any) -> Batch:
        if self.batch_fn is not None:
            pair = self.batch_fn(batch)
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise UserError(f"batch_fn returned a {type(pair).__name__}; fix: return (inputs, target), "
                                "with target None when the model computes its own loss")
            args, kwargs = self._inputs(pair[0])
            return Batch(args, kwargs, pair[1])
        if isinstance(batch, torch.Tensor):
            return Batch((batch,), {}, None)
        if isinstance(batch, Mapping):
            key = next((k for k in TARGET_KEYS if k in batch), None)
            target = batch[key] if key is not None else None
            return Batch((batch,), {}, target) if self._as_one(batch) else Batch((), self._keep(batch), target)
        if isinstance(batch, (tuple, list)) and batch:
            if len(batch) == 1:
                return Batch((batch[0],), {}, None)
            args = tuple(batch[:-1])
            # The first target parameter of forward that the inputs leave unfilled, if any (nanoGPT's targets).
            name = next((k for k in TARGET_KEYS if self.target_params.get(k, -1) >= len(args)), None)
            return Batch(args, {} if name is None else {name: batch[-1]}, batch[-1])
        raise UserError(f"data: a batch of type {type(batch).__name__}; fix: have the Dataset return a tensor, "
                        "a tuple (inputs..., target) or a dict, or pass batch_fn=lambda b: (inputs, target)")


def _as_tensor(field: Any) -> Any:
    """A field that is a list of Python numbers, or of such lists (as Hugging Face datasets give it
    unformatted), as a tensor; any other field as it is."""
    first = field
    while isinstance(first, list) and first:
        first = first[0]
    return torch.tensor(field) if isinstance(field, list) and isinstance(first, (int, float)) else field


def _as_tensors(sample: Any) -> Any:
    """A sample with its number-list fields as tensors (a dict's values, a tuple's items)."""
    if isinstance(sample, Mapping):
        return {k: _as_tensor(v) for k, v in sample.items()}
    if isinstance(sample, tuple):
        return tuple(_as_tensor(v) for v in sample)
    return sample


def collate(samples: list[Any]) -> Any:
    """The loaders' collate: torch's default_collate, after a field that holds a list of numbers per sample (a
    Hugging Face dataset's ``input_ids`` without ``set_format("torch")``) is made a tensor, so the batch has it
    as (B, n); default_collate would give a list of n tensors of (B,), which no model takes. Fields of unequal
    lengths are one line naming the field (they need padding)."""
    from torch.utils.data import default_collate

    samples = [_as_tensors(s) for s in samples]
    try:
        return default_collate(samples)
    except RuntimeError as err:
        if "equal size" not in str(err) or not isinstance(samples[0], (Mapping, tuple)):
            raise
        first = samples[0]
        fields = first.items() if isinstance(first, Mapping) else enumerate(first)
        for key, value in fields:
            sizes = {tuple(s[key].shape) for s in samples if isinstance(s[key], torch.Tensor)}
            if isinstance(value, torch.Tensor) and len(sizes) > 1:
                a, b = sorted(sizes)[:2]
                what = f"field {key!r}" if isinstance(first, Mapping) else f"item {key}"
                raise UserError(f"data: the samples' {what} has different shapes in one batch ({a} and {b}); fix: "
                                "pad each batch with collate_fn= (transformers' DataCollatorWithPadding(tokenizer), "
                                "or any function of a list of samples), or pad or truncate every sample to one "
                                "length in the dataset (a tokenizer's padding='max_length', truncation=True, "
                                "max_length=N)") from None
        raise


def _first_input(batch: Batch) -> Any:
    return next(iter([*batch.args, *batch.kwargs.values()]), None)


def _first(dataset: Any) -> Any:
    """The data set's first sample (a stream's first item)."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        if first is None:
            raise UserError(f"data: the training stream ({type(dataset).__name__}) gave no items; fix: pass a "
                            "stream with data in it")
        return first
    return dataset[0]


def _same(a: Any, b: Any) -> bool:
    """Whether two batches have one structure and equal tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and list(a) == list(b) \
            and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b) \
            and all(_same(x, y) for x, y in zip(a, b))
    return True


def one_sample(batcher: Batcher, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> Batch:
    """The data set's first sample as a batch of one, collated as the loader collates and split for the model:
    what the FLOP count and the memory measurements run. Its ``repeat(n)`` stacks n copies of each tensor when
    that is what the loader gives for n copies of the sample (the common case: a default_collate, a padding
    collator); when it is not (a list of images per batch, as torchvision's detection models take, or a tensor
    the collate_fn gives once per batch), it collates the n copies itself."""
    collate_fn = collate_fn or collate
    first = _first(dataset)
    one = batcher(collate_fn([first]))
    two = batcher(collate_fn([first, first]))
    a, b = _first_input(one), _first_input(two)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and (len(a), len(b)) == (1, 2):
        batcher.listed = True  # a list of an item per sample, not a tuple of stacked inputs: its length counts
        one, two = (dataclasses.replace(x, listed=True) for x in (one, two))
    try:
        stacks = _same(dataclasses.replace(one, grow=None).repeat(2), two)
    except RuntimeError:  # a tensor of another leading size than 1: it does not stack
        stacks = False
    if stacks:
        return one

    def grow(n: int) -> Batch:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the planner measures under fake tensors; the collate runs on real ones
            return batcher(collate_fn([first] * n))

    return dataclasses.replace(one, grow=grow)
