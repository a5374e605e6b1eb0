"""A model of one's own built on fake tensors, for the planner (plan/estimate.py) and fit()'s plan vs actual.

Building it under torch's FakeTensorMode gives every tensor it makes shapes and dtypes but no values, and so
no memory: how a 70B model is planned on a laptop. Some models read a value while they are built, which a fake
tensor cannot answer (torch's DataDependentOutputException, a page of traceback): timm's and transformers'
vision models spread stochastic depth over their blocks with ``[x.item() for x in torch.linspace(0, rate,
depth)]`` (timm's ViT, ConvNeXt, Swin, EfficientNet; transformers' ConvNext, Swin, BEiT), and torch's own
nn.init.trunc_normal_ redraws until its values are in range (transformers' ViT, DeiT, BEiT). Such a model is
built, in turn:

1. on the meta device, where torch's initializers return at once and a value asked for on the CPU by name (as
   timm's drop-path rates are) is real; then every tensor is made fake;
2. else with the tensors that carry values real: the ranges (linspace, logspace, arange, tensor, as_tensor)
   and whatever is computed from real tensors alone (their .item(), .tolist(), a relative-position index) run
   outside the fake mode, the parameters (torch.empty and the other allocations) inside it; what came out
   real, small by construction, is made fake after the build (FakeTensorMode.from_tensor).

Either way the measured steps see a model of fake tensors only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

# What fake tensors cannot compute: a value read (.item(), .tolist(), a Python branch on a tensor), an output
# whose shape depends on the values (nonzero, boolean masks: a mixture of experts' routing), an operator
# without a fake kernel. A model that needs one is not planned on fake tensors.
FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
# Factories whose values a model may read while it is built (their size is given, small: depths, windows)
_VALUED = (torch.linspace, torch.logspace, torch.arange, torch.tensor, torch.as_tensor)


class _RealValues(TorchFunctionMode):
    """Within a build: the _VALUED factories, and any function whose tensor arguments are all real, run outside
    the fake mode; everything else (the parameters' allocations, ops on fake tensors) inside it."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        real = not any(isinstance(t, FakeTensor) for t in tensors) if tensors else func in _VALUED
        if real:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _all_fake(model: nn.Module, mode: FakeTensorMode) -> None:
    """Every real parameter, buffer and tensor attribute of ``model`` made fake in ``mode`` (tied ones stay tied)."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            if t.is_meta:  # no values to carry: a fake tensor of its shape (the mode is active: nothing allocated)
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            else:
                data = mode.from_tensor(t.detach())
            made[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        return made[id(t)]

    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is not None and not isinstance(t, FakeTensor):
                    store[name] = fake(t)  # type: ignore[assignment]
        for name, t in list(vars(module).items()):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                setattr(module, name, fake(t))


def build_fake(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under the active FakeTensorMode, or, for a model that reads a value while it is built, as the
    module docstring's routes build it."""
    from torch._guards import detect_fake_mode

    try:
        return build()
    except DataDependentOutputException:
        pass
    mode = detect_fake_mode()
    assert mode is not None, "build_fake runs under a FakeTensorMode"
    try:
        with unset_fake_temporarily(), torch.device("meta"):
            model = build()
    except (RuntimeError, NotImplementedError):  # it reads a value a meta tensor has not
        return _build_with_real_values(build, mode)
    _all_fake(model, mode)
    return model


def _build_with_real_values(build: Callable[[], nn.Module], mode: FakeTensorMode) -> nn.Module:
    """The module docstring's second route, under ``mode`` (the active one)."""
    allowed = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True  # a fake parameter initialized from a real tensor (copy_, mul): made fake
    try:
        with _RealValues():
            model = build()
        _all_fake(model, mode)
    finally:
        mode.allow_non_fake_inputs = allowed
    return model


def build_shapes(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with nothing allocated: on the meta device (the cheapest), or, for a model that reads a value
    while it is built (a meta tensor has none), on fake tensors with its valued tensors real."""
    try:
        with torch.device("meta"):
            return build()
    except (RuntimeError, NotImplementedError):  # "Tensor.item() cannot be called on meta tensors", ...
        with FakeTensorMode() as mode:
            return _build_with_real_values(build, mode)


def why_not_fake(err: BaseException) -> str:
    """What a model's failure on fake tensors (one of FAKE_LIMITS, or a RuntimeError raised inside a fake or meta
    kernel) says of the model, in a few words."""
    func = getattr(err, "func", None)
    if isinstance(err, DynamicOutputShapeException):
        return f"an op of its forward makes a tensor whose shape depends on the data ({func}: a mixture of " \
               "experts' routing, a boolean mask)"
    if isinstance(err, DataDependentOutputException):
        return f"it reads a tensor's value ({func}: .item(), .tolist() or a Python branch on a tensor)"
    if isinstance(err, UnsupportedOperatorException):
        return f"an op has no fake-tensor kernel ({func})"
    first = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
    return f"an op failed on them ({first})"


# What a step on fake tensors raises where it cannot run (FAKE_LIMITS), or a RuntimeError of a fake or meta kernel.
NOT_RUNNABLE = (*FAKE_LIMITS, RuntimeError)


class NotFakeable(Exception):
    """A model of one's own that fake tensors cannot run; its message: why, in a few words (why_not_fake)."""


class LossNotFakeable(NotFakeable):
    """The user's loss_fn, not the model, is what fake tensors cannot run (fake_loss)."""


def fake_loss(loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``loss_fn(output, target)`` for a planned step (plan/estimate.py wraps a user's loss so): what fake tensors
    cannot run in it raised as LossNotFakeable, so that the one line names the loss, not the model."""
    @functools.wraps(loss_fn)
    def loss(output: Any, target: Any) -> Any:
        try:
            return loss_fn(output, target)
        except NOT_RUNNABLE as err:
            raise LossNotFakeable(why_not_fake(err)) from err

    return loss


@contextlib.contextmanager
def on_fake_tensors() -> Iterator[None]:
    """Around the planner's fake steps of a model of one's own: what fake tensors cannot run raised as
    NotFakeable (a model's own bug, a RuntimeError, is said too), and the whole stack torch's fake mode logs of
    an op its meta kernel refused (log.exception) left unsaid: the one line said of it is the caller's."""
    logger = logging.getLogger(FakeTensorMode.__module__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    except NOT_RUNNABLE as err:
        raise NotFakeable(why_not_fake(err)) from err
    finally:
        logger.setLevel(level)
