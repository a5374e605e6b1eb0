"""The bench's arithmetic and parsing: nccl-tests' bandwidth formulas against hand-computed numbers, sizes,
lists, and the one-line errors for bad input."""

from __future__ import annotations

import pytest

from scaletrain.bench.units import (
    OPS,
    algbw,
    bus_factor,
    busbw,
    format_size,
    parse_choice,
    parse_int,
    parse_ints,
    parse_names,
    parse_size,
    parse_sizes,
)
from scaletrain.errors import ConfigError


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0  # 2 x 1/2
    assert bus_factor("all_reduce", 8) == 1.75  # 2 x 7/8
    assert bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 0.875
    assert bus_factor("broadcast", 8) == 1.0


@pytest.mark.parametrize("op, world, size, seconds, alg, bus", [
    # 1 GB (1e9 bytes) all-reduced by 4 ranks in 0.5 s: algbw 2 GB/s, busbw 2 x 2 x 3/4 = 3 GB/s.
    ("all_reduce", 4, 10**9, 0.5, 2e9, 3e9),
    # 256 MiB gathered by 8 ranks in 0.1 s: algbw 2.68435456 GB/s, busbw x 7/8 = 2.34881024 GB/s.
    ("all_gather", 8, 256 * 2**20, 0.1, 2.68435456e9, 2.34881024e9),
    # 64 MiB reduce-scattered by 2 ranks in 20 ms: algbw 3.3554432 GB/s, busbw x 1/2.
    ("reduce_scatter", 2, 64 * 2**20, 0.02, 3.3554432e9, 1.6777216e9),
    ("broadcast", 16, 1000, 1e-6, 1e9, 1e9),
])
def test_algbw_and_busbw(op, world, size, seconds, alg, bus):
    assert algbw(size, seconds) == pytest.approx(alg, rel=1e-12)
    assert busbw(op, size, seconds, world) == pytest.approx(bus, rel=1e-12)


@pytest.mark.parametrize("text, size", [
    ("1KB", 1024), ("256MB", 256 * 2**20), ("1GB", 2**30), ("512", 512), ("512B", 512), ("1.5KB", 1536),
    ("4k", 4096), ("2MiB", 2 * 2**20), (" 8 kb ", 8192), ("1gib", 2**30),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "KB", "1XB", "-1KB", "0", "0KB", "0.3B", "1.1B", "1 K B", "ten"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    message = str(info.value)
    assert message.startswith(f"--sizes = {text!r}: expected ") and "fix: --sizes 1KB..256MB" in message


def test_parse_sizes_ranges_double_and_lists_merge():
    assert parse_sizes("1KB..8KB") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1KB..3KB") == [1024, 2048]  # doubling stops at the last size <= the end
    assert parse_sizes("4KB,1KB,1KB") == [1024, 4096]
    assert parse_sizes("1KB..2KB,1MB") == [1024, 2048, 2**20]
    assert parse_sizes("1KB..1KB") == [1024]
    assert len(parse_sizes("1KB..256MB")) == 19


def test_parse_sizes_backwards_range_says_the_fix():
    with pytest.raises(ConfigError) as info:
        parse_sizes("8KB..1KB")
    assert "a..b with a <= b" in str(info.value) and "fix: --sizes 1KB..8KB" in str(info.value)
    with pytest.raises(ConfigError):
        parse_sizes("1KB..")


def test_format_size_reads_back():
    for size in (1, 512, 1024, 1536, 2**20, 3 * 2**20, 256 * 2**20, 2**30):
        assert parse_size(format_size(size)) == size
    assert format_size(256 * 2**20) == "256MB"


def test_int_lists():
    assert parse_ints("1,2,4", "--nproc") == [1, 2, 4]
    assert parse_ints("2, 2 ,1", "--nproc") == [2, 1]
    assert parse_int("0", "--warmup", minimum=0) == 0
    for bad in ("0", "1,x", "", "1.5", "-2"):
        with pytest.raises(ConfigError) as info:
            parse_ints(bad, "--nproc", example="1,2")
        assert str(info.value).startswith(f"--nproc = {bad!r}: expected") and "fix: --nproc 1,2" in str(info.value)
    with pytest.raises(ConfigError, match="one integer"):
        parse_int("1,2", "--steps")


def test_names_and_choices():
    assert parse_names("all", "--ops", OPS) == list(OPS)
    assert parse_names("broadcast,all_reduce", "--ops", OPS) == ["broadcast", "all_reduce"]
    with pytest.raises(ConfigError) as info:
        parse_names("allreduce", "--ops", OPS)
    assert "('allreduce' is not one)" in str(info.value) and "fix: --ops all_reduce" in str(info.value)
    assert parse_choice("gloo", "--backend", ("auto", "gloo", "nccl")) == "gloo"
    with pytest.raises(ConfigError) as info:
        parse_choice("mpi", "--backend", ("auto", "gloo", "nccl"))
    assert "expected one of auto, gloo, nccl" in str(info.value)


@pytest.mark.parametrize("argv, said", [
    (["/repo/.venv/bin/scaletrain", "bench", "allreduce", "--nproc", "2"], "scaletrain bench allreduce --nproc 2"),
    (["benchmarks/step_curve.py", "--timm", "convnext_tiny"], "python benchmarks/step_curve.py --timm convnext_tiny"),
    (["/site/scaletrain/__main__.py", "plan", "gpt-stdlib"], "scaletrain plan gpt-stdlib"),
])
def test_a_results_command_is_the_one_typed(monkeypatch, argv: list[str], said: str) -> None:
    """A benchmark run with python recorded its command as 'scaletrain ...' in its results' environment."""
    from scaletrain.bench.report import environment

    monkeypatch.setattr("sys.argv", argv)
    assert environment()["command"] == said
