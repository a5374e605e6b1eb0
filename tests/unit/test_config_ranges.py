"""Every config key has a declared range, and load() holds every value to it (issue 19).

The schema is enumerated, so a key added later is covered without touching this file: each key is driven
with wrong types, NaN, inf, huge and negative numbers and empty strings, from the command line (strings),
the library's mapping (Python values) and a TOML file (typed values). load() either accepts the value, which
must then be the value given and inside the key's declared range, or raises ConfigError naming the key:
never another exception, never a value outside the documented range. Then the same through the real CLI.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletrain.cli import main
from scaletrain.config import (
    CLI,
    LIBRARY,
    ChaosConfig,
    Config,
    Range,
    RunConfig,
    Text,
    all_keys,
    allowed,
    build,
    check_run_dir,
    flatten,
    load,
    spec,
    tomllib,
)
from scaletrain.errors import ConfigError

KEYS = sorted(all_keys())
TOML = "exp.toml"  # an origin whose values are typed, not parsed: what read_source hands to build()
HUGE = 10**5000  # more digits than Python will print

HOSTILE: list[Any] = [
    math.nan, math.inf, -math.inf, 2**64, 10**30, -(10**30), 2**63, -(2**63) - 1, 2**31, 2**32, -1, -2, 0, 1, 7,
    0.5, -0.5, -0.0, 1e-300, 1e300, HUGE, "", " ", "nan", "inf", "-inf", "1e30", "1e-300", "-1", "0", "0x10",
    "1_000", "true", "\x00", "a\nb", "cuda:128", "host:0", "host:65536", True, False, None, [], {},
]


def _as_text(value: Any) -> str:
    """What a user would type for ``value`` on the command line."""
    if isinstance(value, int) and abs(value) > 10**1000:
        return "9" * 5000
    return value if isinstance(value, str) else str(value)


def _load(key: str, value: Any, origin: str) -> Config:
    if origin == CLI:
        return load(None, cli_overrides={key: _as_text(value)})
    if origin == LIBRARY:
        return load(None, overrides={key: value})
    return build([(TOML, {key: value})])


def _given(tp: Any, value: Any, origin: str) -> Any:
    """The value load() must keep when it accepts ``value``: the one given, parsed as its origin parses."""
    value = _as_text(value) if origin == CLI else value
    if origin in (CLI, LIBRARY) and isinstance(value, str):
        if tp is int:
            return int(value.replace("_", ""))
        if tp is float:
            return float(value)
        if tp is bool:
            return value.lower() in ("true", "1", "yes", "on")
    return float(value) if tp is float else value


def check_one(key: str, value: Any, origin: str) -> None:
    """Either a one-line ConfigError that names the key, or the value given, inside its declared range."""
    try:
        cfg = _load(key, value, origin)
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message and "fix: " in message, message
        assert key in message, message  # a rule between keys names both (model.n_head and model.n_embd)
        return
    section, name = key.split(".")
    got = getattr(getattr(cfg, section), name)
    tp = all_keys()[key][0]
    if get_origin(tp) is Literal:
        assert got in get_args(tp)
    elif tp is bool:
        assert type(got) is bool
    elif tp is str:
        assert type(got) is str and got.isprintable() and spec(key).allows(got)  # type: ignore[union-attr]
    else:
        assert type(got) is tp, (key, value, got)
        assert math.isfinite(got) if tp is float else -(2**63) <= got <= 2**63 - 1, (key, value, got)  # a C type's
        assert spec(key).allows(got), (key, value, got, allowed(key))  # type: ignore[union-attr]
    assert got == _given(tp, value, origin), (key, value, got)  # kept as given: nothing clamped or rounded
    assert build([("config.toml", flatten(tomllib.loads(cfg.to_toml()), "config.toml"))]) == cfg  # round trip


def test_every_key_declares_a_range_its_default_lies_in_and_help_shows():
    from scaletrain.cli.options import Parser, add_config_options

    parser = Parser(prog="scaletrain train")
    add_config_options(parser)
    help_text = " ".join(parser.format_help().split())
    defaults = Config().to_dict()
    for key in KEYS:
        tp, declared = all_keys()[key][0], spec(key)
        if tp in (int, float):
            assert isinstance(declared, Range), f"{key}: declare Annotated[{tp.__name__}, Range(...)]"
            top = declared.high if declared.high is not None else declared.most
            assert tp is float or (top is not None and top <= 2**63 - 1), f"{key}: an integer needs a ceiling"
            assert not any(declared.allows(v) for v in (math.nan, math.inf, -math.inf, -(10**30)))
            assert tp is float or not any(declared.allows(v) for v in (2**63, 2**64, 10**30))  # beyond int64
            assert " ".join(allowed(key).split()) in help_text, key  # --help documents the range
        elif tp is str:
            assert isinstance(declared, Text), f"{key}: declare Annotated[str, Text(...)]"
        else:
            assert tp is bool or get_origin(tp) is Literal, key  # their type is their choice set
        section, name = key.split(".")
        assert spec(key) is None or spec(key).allows(defaults[section][name]), key  # type: ignore[union-attr]


@pytest.mark.parametrize("origin", [CLI, LIBRARY, TOML])
def test_every_key_against_every_hostile_value(origin):
    for key in KEYS:
        for value in HOSTILE:
            check_one(key, value, origin)


VALUES = st.one_of(st.sampled_from(HOSTILE), st.integers(), st.floats(), st.text(max_size=8), st.booleans(),
                   st.integers(min_value=-(2**70), max_value=2**70))


@settings(max_examples=500, deadline=None, database=None)
@given(key=st.sampled_from(KEYS), value=VALUES, origin=st.sampled_from([CLI, LIBRARY, TOML]))
def test_any_value_of_any_key_is_kept_in_range_or_refused_in_one_line(key, value, origin):
    check_one(key, value, origin)


@settings(max_examples=100, deadline=None, database=None)
@given(rank=st.integers(-1, 2**31 - 1), world=st.integers(1, 2**16))
def test_a_chaos_rank_must_exist_in_the_world(rank, world):
    chaos = ChaosConfig(kill_rank=rank, signal_rank=rank)
    if rank < world:
        chaos.check_world(world)
    else:
        with pytest.raises(ConfigError, match=rf"^chaos.kill_rank = {rank}: expected a rank below the world "
                                              rf"size {world} \(0 to {world - 1}\), or -1 \(off\); fix: "):
            chaos.check_world(world)


def test_every_rank_checks_the_chaos_ranks_against_its_world():
    """Where no launcher of ours checked them (torchrun, fit(), a session): when the trainer builds its Chaos."""
    from scaletrain.train.chaos import Chaos

    Chaos(ChaosConfig(nan_rank=1), rank=0, world=2)
    with pytest.raises(ConfigError, match=r"^chaos.nan_rank = 2: expected a rank below the world size 2 \(0 to 1\)"):
        Chaos(ChaosConfig(nan_rank=2), rank=0, world=2)


def test_sections_built_by_hand_are_held_to_the_same_ranges():
    with pytest.raises(ConfigError, match=r"^run.seed = 18446744073709551616: expected an integer >= 0 \(at most "
                                          r"4294967295\); fix: --run.seed=0$"):
        RunConfig(seed=2**64)
    with pytest.raises(ConfigError, match=r"^chaos.hang_s = inf: expected seconds >= 0 \(at most 31536000\)"):
        ChaosConfig(hang_s=math.inf)
    with pytest.raises(ConfigError, match=r"^chaos.kill_rank = '1': expected a rank"):
        ChaosConfig(kill_rank="1")  # type: ignore[arg-type]


def test_a_run_dir_is_checked_without_creating_it(tmp_path):
    check_run_dir(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("")
    where = re.escape(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=rf"^run.dir = '{where}/run': expected a directory this process can "
                                          rf"create and write \({where} is not a directory\); fix: "):
        check_run_dir(tmp_path / "file" / "run")
    with pytest.raises(ConfigError, match="File name too long"):
        check_run_dir(tmp_path / ("x" * 300))
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # the probe of a writable place left nothing


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Linux's /proc")
def test_a_run_dir_where_the_permissions_say_yes_and_mkdir_says_no():
    """/proc as root: os.access said writable, and rank 0 crashed creating the directory after start-up."""
    with pytest.raises(ConfigError, match=r"^run.dir = '/proc/nope': expected a directory this process can create "
                                          r"and write \(/proc refuses a new directory \("):
        check_run_dir(Path("/proc/nope"))


def test_toml_values_beyond_any_range(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text("[run]\nseed = 18446744073709551616\n")
    with pytest.raises(ConfigError, match=r"^run.seed = 18446744073709551616 \(.*exp.toml\): expected an integer"):
        load(str(path))
    path.write_text("[chaos]\nhang_s = inf\n")
    with pytest.raises(ConfigError, match=r"^chaos.hang_s = inf \(.*exp.toml\): expected seconds >= 0"):
        load(str(path))
    path.write_text(f"[run]\nseed = {'9' * 5000}\n")
    with pytest.raises(ConfigError, match=r"^config = .*exp.toml' \(.*exp.toml\): expected valid TOML"):
        load(str(path))


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("args, words", [
    (["--run.seed=1e30"], ["run.seed = '1e30' (command line)", "an integer >= 0 (at most 4294967295)",
                           "fix: --run.seed=0"]),
    (["--run.seed=18446744073709551616"], ["run.seed = 18446744073709551616", "(at most 4294967295)"]),
    (["--chaos.delay_ms=inf"], ["chaos.delay_ms = inf", "milliseconds >= 0 (at most 3600000)"]),
    (["--chaos.hang_s=inf"], ["chaos.hang_s = inf", "seconds >= 0 (at most 31536000)"]),
    (["--parallel.bucket_mb=inf"], ["parallel.bucket_mb = inf", "megabytes >= 0.001 (at most 1048576)"]),
    (["--parallel.bucket_mb=1e-300"], ["parallel.bucket_mb = 1e-300", "fix: --parallel.bucket_mb=25"]),
    (["--dist.timeout_s=99999999999999"], ["dist.timeout_s = 99999999999999", "seconds >= 1 (at most 31536000)"]),
    (["--log.straggler_min_frac=inf"], ["log.straggler_min_frac = inf", "a fraction of the step time > 0"]),
    (["--optim.grad_clip=inf"], ["optim.grad_clip = inf", "a finite number >= 0", "fix: --optim.grad_clip=1.0"]),
    (["--nnodes=2", "--rdzv-endpoint=node0:99999"], ["dist.rdzv_endpoint = 'node0:99999'",
                                                    "a port in [1, 65535]", "fix: --rdzv-endpoint=node0:29500"]),
    (["--nproc=2", "--chaos.kill_rank=2"], ["chaos.kill_rank = 2: expected a rank below the world size 2 (0 to 1)",
                                           "fix: --chaos.kill_rank=1"]),
    (["--nproc=2", "--run.dir=file/run"], ["run.dir = 'file/run'", "file is not a directory"]),
    (["--run.dir=file/run"], ["run.dir = 'file/run'", "file is not a directory"]),
])
def test_the_cli_says_a_bad_value_in_one_line_and_starts_nothing(args, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    code, lines = run_main(["train", "digits", "--train.max_steps=2", *args], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("scaletrain: error: ")
    for word in words:
        assert word in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no run directory, nothing written


def test_launch_checks_its_options_before_starting_workers(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(3)\n")
    code, lines = run_main(["launch", "--nproc", "1e30", str(script)], capsys)
    assert (code, len(lines)) == (2, 1) and "dist.nproc = '1e30' (command line): expected an integer >= 1 (at " \
                                          "most 1024); fix: --nproc 2" in lines[0]
    code, lines = run_main(["launch", "--nnodes", "2", "--rdzv-endpoint", "node0:0", str(script)], capsys)
    assert (code, len(lines)) == (2, 1) and "dist.rdzv_endpoint = 'node0:0'" in lines[0]


def test_a_real_process_says_a_huge_seed_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([str(Path(sys.executable).with_name("scaletrain")), "train", "digits", "--run.seed=1e30"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [(
        "scaletrain: error: run.seed = '1e30' (command line): expected an integer >= 0 (at most 4294967295); "
        "fix: --run.seed=0")]
    assert "Traceback" not in proc.stdout + proc.stderr and not list(tmp_path.iterdir())
