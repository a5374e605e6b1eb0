"""A plan for a model of one's own: ``scaletrain.plan_fit(Model, train_data, gpu="h100", config=...)``, what
fit() with the same arguments would run.

What `scaletrain plan` does for a recipe, for the model and data ``fit()`` would take: the model is built by its
class (or a function of no arguments) on fake tensors, so a 70B model of transformers' is planned on a laptop
without allocating it; its first training sample, as fit()'s loader collates and splits it (batch_fn, collate_fn,
the target by name when forward takes one), is what one forward and backward are measured on, at batch 1 and 2,
as DDP and as FSDP run them, with and without full activation checkpointing (estimate.py's model). The layouts,
their memory per GPU, time per step, the run's time and cost, and the choice are the recipe plan's; the steps
are the run's own (train.max_steps, or train.epochs over the data minus fit()'s held-out share).

Not for a model of one's own: the dp x tp x pp search (tensor and pipeline parallelism split the built-in models
only), and extrapolation by depth (the whole model is measured: seconds for a few billion parameters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from scaletrain.config import Config, ModelConfig
from scaletrain.errors import UserError, says_errors
from scaletrain.plan.fake_build import LossNotFakeable, NotFakeable, build_shapes, on_fake_tensors


@says_errors
def plan_fit(model: Callable[[], nn.Module], train_data: Any, *, gpu: str = "h100",
         config: Config | Mapping[str, Any] | str | None = None, argv: list[str] | None = None,
         batch_fn: Callable[[Any], tuple[Any, Any]] | None = None,
         collate_fn: Callable[[list[Any]], Any] | None = None, mfu: float | None = None,
         price_per_gpu_hour: float | None = None, net_gbps: float = 400.0, show: bool = True,
         optimizer: Callable[[list[nn.Parameter]], Any] | None = None, eval_data: Any = None,
         loss_fn: Callable[[Any, Any], Any] | None = None, scheduler: Any = None, metrics: Any = None,
         on_eval: Any = None) -> dict[str, Any]:
    """Plan training ``model`` (its class, or a function of no arguments that builds it: it is called on fake
    tensors) on ``train_data`` (what fit() takes) on ``gpu`` (h100, h200, a100-80gb, a100-40gb, l40s, l4), with
    ``config`` and ``argv`` as fit() takes them: dist.nproc GPUs per machine, dist.nnodes machines,
    data.batch_size, train.precision, optim.name, train.max_steps or train.epochs, parallel.fsdp_units. ``mfu``:
    the model FLOPs utilization a run without recompute reaches (default: the measured run nearest in size,
    plan/catalog.py). Prints the plan as `scaletrain plan` does (``show``) and returns it as its --json has it.
    ``optimizer``: fit()'s, as a function of the parameters (called on the model built on the meta device): its
    state is planned as SGD's one buffer per parameter, or Adam's two for any other, in place of optim.name's.
    ``eval_data``: fit()'s; without it data.val_fraction of ``train_data`` is held out, as fit() holds it out.
    ``loss_fn``: fit()'s; the step is measured backward from it (its temporaries are the step's too: a one-hot or
    a similarity matrix it builds), else from the model's own loss, or cross-entropy of its logits, or what it
    returns. ``scheduler``, ``metrics``, ``on_eval``: fit()'s too, taken so that a fit() call plans by its name
    alone; they do not change the plan."""
    from scaletrain.batch import Batcher, one_sample
    from scaletrain.data import in_memory, train_size
    from scaletrain.plan.catalog import ACCELERATORS, default_mfu
    from scaletrain.plan.estimate import AC_PLANNED, OWN, make_plan, measure_model
    from scaletrain.plan.table import WIDTH, print_plan, say
    from scaletrain.train.batching import plan_batches
    from scaletrain.train.job import builder, name_of
    from scaletrain.train.session import loaders_read, resolve_config

    acc = ACCELERATORS.get(gpu.lower())
    if acc is None:
        raise UserError(f"gpu = {gpu!r}: expected one of {', '.join(ACCELERATORS)}; fix: gpu='h100'")
    if mfu is not None and not 0 < mfu <= 1:
        raise UserError(f"mfu = {mfu!r}: expected a fraction in (0, 1]; fix: mfu=0.4")
    if isinstance(model, nn.Module):
        raise UserError(f"model: a {type(model).__name__} already built; fix: pass its class, or a function of no "
                        f"arguments that builds it (lambda: {type(model).__name__}(config)): the plan builds it on "
                        "fake tensors, so nothing is allocated")
    build = builder(model, instead="a function")
    # the data are the arguments; several machines need no rendezvous to be planned (the run will)
    given = {"data.source": "memory", "dist.rdzv_endpoint": "planned:29500"}
    del scheduler, metrics, on_eval  # fit()'s, taken as it takes them (see above)
    info: dict[str, Any] = {"build": build}
    if loss_fn is not None:  # as fit() calls it: a function of the wrong shape, or a wrong return, is one line
        from scaletrain.train.job import checked_loss

        info["loss_fn"] = checked_loss(loss_fn)
    train_data, eval_data, collate_fn, loader, _ = loaders_read(train_data, eval_data, collate_fn)  # a DataLoader's
    cfg = resolve_config(config, argv, defaults={**loader, **given}, pinned=given).for_device("cuda")  # for a GPU
    cfg = dataclasses.replace(cfg, model=ModelConfig())  # the model is the user's: no built-in's key applies
    splits = in_memory(train_data, eval_data, cfg.data.val_fraction, collate_fn=collate_fn)
    world = cfg.dist.nproc * cfg.dist.nnodes
    batches = plan_batches(cfg, world, train_size(splits.train))
    signature = build_shapes(build)  # its forward's signature, for the batch's split (nothing allocated)
    if optimizer is not None:  # its kind of state, from the optimizer built on the meta parameters
        from scaletrain.train.job import optim_kind, own_optimizer

        kind = optim_kind(cfg, own_optimizer(optimizer, signature, built=True), optimizer)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name=kind))
    one = one_sample(Batcher(signature, batch_fn), splits.train, collate_fn)
    try:
        with on_fake_tensors():
            facts = measure_model(cfg, OWN, info, one, modes=AC_PLANNED)  # type: ignore[arg-type]
    except LossNotFakeable as err:
        raise UserError(f"loss_fn: {name_of(loss_fn)} cannot be planned: the plan runs it on the output of one forward "
                        f"on fake tensors (shapes, no data), and {err}; fix: give plan_fit the same loss without that op "
                        "(what it prints or logs left out), or plan without loss_fn (the default cross-entropy's "
                        "memory)") from None
    except NotFakeable as err:
        raise UserError(f"model: {type(signature).__name__} cannot be planned: the plan runs one forward and "
                        f"backward of it on fake tensors (shapes, no data), and {err}; fix: measure "
                        "it in a real run instead (a few steps of fit() on one GPU: summary.json's peak_mem_bytes is "
                        "each rank's peak), or plan a model without that op") from None
    source = f"given (mfu={mfu})"
    if mfu is None:
        mfu, source = default_mfu(acc.key, compiled=cfg.train.compile, params=facts.params,
                                  tokens=cfg.data.batch_size * facts.tokens_per_sample)
    planned = make_plan(cfg, facts, acc, total_steps=batches.total_steps, accum_steps=batches.accum_steps, mfu=mfu,
                        net_bytes_per_s=net_gbps * 1e9 / 8, price_per_gpu_hour=price_per_gpu_hour)
    if show:
        name = type(signature).__name__  # the model's class, whatever built it (a lambda has no name to show)
        print_plan(name, planned, batches.describe(), WIDTH, mfu_source=source)
        split = {k: v for k, v in (("parallel.tp", cfg.parallel.tp), ("parallel.pp", cfg.parallel.pp)) if v > 1}
        if split:  # asked for, and not what the table plans: said, not dropped in silence
            given = " and ".join(f"{k} = {v}" for k, v in split.items())
            say(f"plan: {given} not planned: a model of one's own is planned with data parallelism (DDP, FSDP) over "
                f"all {world} GPUs (the dp x tp x pp search covers the built-in GPT and Llama only)", WIDTH)
        if facts.units == 1:
            say(f"plan: {name} has no repeated blocks scaletrain can find, so FSDP's unit is the whole model (its "
                "working set a whole replica in the compute dtype); name its blocks with config "
                "{'parallel.fsdp_units': 'MyBlock'} (their class)", WIDTH)
    return planned.as_dict()
