"""Strategy names map onto (dp_replicate, dp_shard) degrees in one place; wrong ones are one-line errors."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import MemoryConfig, ParallelConfig, load
from scaletrain.errors import ConfigError
from scaletrain.layout import Layout
from scaletrain.models import GPT
from scaletrain.parallel import check_layout, is_fsdp, parallelize, resolve_degrees


@pytest.mark.parametrize(("strategy", "replicate", "shard", "world", "nnodes", "want"), [
    ("ddp", 0, 0, 8, 1, (8, 1)),
    ("fsdp", 0, 0, 8, 1, (1, 8)),
    ("hsdp", 0, 0, 16, 2, (2, 8)),  # replicate across the 2 machines, shard within each
    ("hsdp", 2, -1, 4, 1, (2, 2)),  # two "machines" on one: the CPU test of HSDP
    ("hsdp", -1, 2, 8, 1, (4, 2)),
    ("fsdp", 1, -1, 4, 1, (1, 4)),
    ("ddp", -1, 1, 3, 1, (3, 1)),
    ("fsdp", 0, 0, 1, 1, (1, 1)),  # FSDP on one GPU: a 1-rank mesh
])
def test_presets_and_explicit_degrees(strategy, replicate, shard, world, nnodes, want):
    assert resolve_degrees(strategy, replicate, shard, world, nnodes) == want


@pytest.mark.parametrize(("args", "words"), [
    (("hsdp", 2, 3, 8, 1), ["2 x 3 = 6 != 8", "parallel.dp_shard"]),  # the arithmetic, shown
    (("hsdp", 3, -1, 8, 1), ["world size 8 is not a multiple of parallel.dp_replicate = 3",
                             "parallel.dp_shard = -1"]),
    (("hsdp", -1, -1, 8, 1), ["at most one degree of -1"]),
    (("ddp", 0, 2, 8, 1), ["parallel.dp_shard = 2", "--parallel.strategy=fsdp"]),
    (("fsdp", 2, 0, 8, 1), ["parallel.dp_replicate = 2", "--parallel.strategy=hsdp"]),
    (("hsdp", 0, 0, 9, 2), ["same number of ranks on each of the 2 machines"]),
    (("hsdp", 8, 1, 8, 1), ["parallel.dp_shard = 1", "--parallel.dp_replicate=4 (shards of 2 ranks)",
                            "--parallel.strategy=ddp"]),
    (("hsdp", 2, -1, 2, 1), ["parallel.dp_shard = 1", "--parallel.dp_replicate=1 (shards of 2 ranks)"]),
    (("hsdp", 9, -1, 9, 1), ["--parallel.dp_replicate=3 (shards of 3 ranks)"]),  # a fix that itself resolves
    (("fsdp", 0, -2, 8, 1), ["parallel.dp_shard = -2", "-1 (the remaining ranks)"]),
])
def test_wrong_degrees_are_one_line_errors(args, words):
    with pytest.raises(ConfigError) as err:
        resolve_degrees(*args)
    message = str(err.value)
    assert "\n" not in message and "fix:" in message
    for word in words:
        assert word in message, message


def test_config_checks_degrees_and_names_the_sections():
    cfg = load(None, {"parallel.strategy": "hsdp", "parallel.dp_replicate": 2, "parallel.dp_shard": -1,
                      "memory.activation_checkpointing": "selective"})
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard) == (2, -1)
    assert cfg.memory.activation_checkpointing == "selective" and not cfg.memory.cpu_offload
    with pytest.raises(ConfigError, match="at most one degree of -1"):
        load(None, {"parallel.dp_replicate": -1, "parallel.dp_shard": -1})
    with pytest.raises(ConfigError, match="memory.activation_checkpointing"):
        load(None, {"memory.activation_checkpointing": "some"})
    with pytest.raises(ConfigError, match="parallel.strategy"):
        load(None, {"parallel.strategy": "zero3"})


def test_parallelize_on_one_process():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="memory.cpu_offload = True.*--parallel.strategy=fsdp"):
        parallelize(GPT(16, 8, 1, 1, 8), cpu, 1, ParallelConfig(strategy="ddp"), compile=False,
                    memory=MemoryConfig(cpu_offload=True))
    model = GPT(16, 8, 1, 1, 8)
    # no process group: nothing to shard over, so the model runs as it is (with a warning)
    assert parallelize(model, cpu, 1, ParallelConfig(strategy="fsdp"), compile=False) is model
    assert not is_fsdp(model)
    auto = parallelize(model, cpu, 1, ParallelConfig(strategy="auto"), compile=False,
                       sample=torch.zeros(8, dtype=torch.long), batch_size=2)
    assert auto is model  # one rank: auto is ddp, which on one rank is the bare model


def test_layout_checked_before_any_worker_starts():
    check_layout(ParallelConfig(strategy="hsdp", dp_replicate=2, dp_shard=-1), MemoryConfig(), 8)
    check_layout(ParallelConfig(strategy="auto"), MemoryConfig(cpu_offload=True), 8)  # auto then shards
    with pytest.raises(ConfigError, match="2 x 3 = 6 != 8"):
        check_layout(ParallelConfig(strategy="hsdp", dp_replicate=2, dp_shard=3), MemoryConfig(), 8)
    with pytest.raises(ConfigError, match="memory.cpu_offload"):
        check_layout(ParallelConfig(strategy="ddp"), MemoryConfig(cpu_offload=True), 8)


def test_the_layout_is_one_immutable_value_resolved_once_per_run(monkeypatch, tmp_path):
    """A run resolves its Layout once (the degree arithmetic runs once, the precision check once) and every part
    reads it: parallelize() is given it, the loader takes its data-parallel rank and size from it."""
    import dataclasses

    import scaletrain.layout as layout_module
    import scaletrain.train.job as job_module
    from scaletrain import runtime
    from scaletrain.data import digits
    from scaletrain.layout import Layout, resolve_layout
    from scaletrain.train.run import open_stepper

    calls = {"degrees": 0, "precision": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(layout_module, "resolve_degrees", counted("degrees", layout_module.resolve_degrees))
    monkeypatch.setattr(job_module, "check_precision", counted("precision", job_module.check_precision))
    cfg = load(None, {"model.name": "mlp", "dist.device": "cpu", "parallel.strategy": "fsdp",
                      "run.dir": str(tmp_path / "run")})
    job, _ = open_stepper(cfg, runtime.init(cfg.dist), digits(0.2))  # built, set up on its session
    job.st.close(finished=False)
    assert calls == {"degrees": 1, "precision": 1}
    assert job.layout == Layout("fsdp", 1, 1, 1, 1) and job.strategy == "fsdp"
    assert (job.loader.inner.sampler.rank, job.loader.inner.sampler.world) == (0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.layout.dp_shard = 2  # type: ignore[misc]
    hsdp = resolve_layout(ParallelConfig(strategy="hsdp"), MemoryConfig(), 16, 2)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp_size, hsdp.sharded) == (2, 8, 16, True)
    assert hsdp.as_dict() == {"strategy": "hsdp", "world_size": 16, "nnodes": 2, "dp_replicate": 2, "dp_shard": 8,
                              "tp": 1, "pp": 1}
    with pytest.raises(ValueError, match="resolve parallel.strategy=auto first"):
        resolve_layout(ParallelConfig(strategy="auto"), MemoryConfig(), 2)


def test_groups_are_the_ranks_that_differ_only_on_the_axes_named():
    layout = Layout("fsdp", 8, 1, 1, 2, tp=2, pp=2)  # pp 2 x dp_shard 2 x tp 2, row-major
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp_replicate", "dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
