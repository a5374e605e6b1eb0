"""The config tree: precedence, round trip, help completeness, and every kind of bad value."""

from __future__ import annotations

from dataclasses import fields

import pytest

from scaletrain.config import Config, all_keys, field_docs, load, sections
from scaletrain.errors import ConfigError
from scaletrain.train.batching import plan_batches


def test_defaults_build_and_every_field_has_a_help_line():
    cfg = load()
    assert isinstance(cfg, Config)
    for sec, cls in sections().items():
        docs = field_docs(cls)
        missing = [f.name for f in fields(cls) if not docs.get(f.name)]
        assert not missing, f"[{sec}] fields without a docstring: {missing}"
    assert len(all_keys()) >= 50


def test_precedence_defaults_then_toml_then_command_line(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text('[optim]\nlr = 0.5\nname = "sgd"\n[train]\nepochs = 3\n')
    cfg = load(str(path), cli_overrides={"optim.lr": "0.25"})
    assert cfg.optim.lr == 0.25  # command line beats the file
    assert cfg.optim.name == "sgd" and cfg.train.epochs == 3  # the file beats the defaults
    assert cfg.optim.momentum == 0.9  # default kept
    assert cfg.run.name == "exp"  # a file names the run after itself


def test_recipe_and_resolved_config_round_trip(tmp_path):
    cfg = load("digits", cli_overrides={"data.batch_size": "16", "nproc": "2"})
    assert cfg.run.name == "digits" and cfg.data.batch_size == 16 and cfg.dist.nproc == 2
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    again = load(str(path))
    assert again == cfg and again.digest() == cfg.digest()


def test_the_digest_names_the_computation_not_how_it_is_logged_or_saved():
    base = load("digits")
    same = load("digits", cli_overrides={"log.every": "7", "log.straggler_min_frac": "0.1", "checkpoint.every": "5",
                                         "run.name": "other", "train.progress": "false"})
    assert same.digest() == base.digest()
    assert load("digits", cli_overrides={"optim.lr": "0.2"}).digest() != base.digest()
    assert load("digits", cli_overrides={"train.precision": "bf16-mixed"}).digest() != base.digest()


def test_aliases_map_to_their_keys():
    cfg = load(None, {"nproc": 3, "device": "cpu", "max-restarts": 2})
    assert (cfg.dist.nproc, cfg.dist.device, cfg.dist.max_restarts) == (3, "cpu", 2)


@pytest.mark.parametrize("overrides, key, words", [
    ({"optim.lrr": "0.1"}, "optim.lrr", ["= '0.1'", "(optim.lrr is not one)", "did you mean --optim.lr"]),
    ({"train.lr": "0.1"}, "train.lr", ["did you mean --optim.lr?"]),  # a key under another section
    ({"lr": "0.1"}, "lr", ["did you mean --optim.lr?"]),
    ({"train.epochs": "ten"}, "train.epochs", ["'ten'", "expected an integer", "fix:"]),
    ({"optim.lr": "fast"}, "optim.lr", ["'fast'", "expected a finite number > 0"]),
    ({"train.compile": "maybe"}, "train.compile", ["expected true or false"]),
    ({"model.name": "cnnn"}, "model.name", ["one of mlp, cnn, gpt", "--model.name=cnn"]),
    ({"dist.nproc": "0"}, "dist.nproc", ["= 0", "an integer >= 1", "--nproc 2"]),
    ({"data.batch_size": "-4"}, "data.batch_size", ["an integer >= 1"]),
    ({"model.n_head": "3"}, "model.n_head", ["a divisor of model.n_embd=128"]),
    ({"dist.device": "tpu"}, "dist.device", ["auto, cpu, cuda or cuda:N"]),
    ({"optim.nesterov": "true", "optim.momentum": "0"}, "optim.nesterov", ["optim.momentum = 0"]),
])
def test_bad_values_name_key_value_allowed_and_fix(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load(None, cli_overrides=overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(key)
    assert "(command line)" in message and "fix:" in message
    for word in words:
        assert word in message


def test_a_value_left_at_its_default_says_so():
    with pytest.raises(ConfigError, match=r"^dist.rdzv_endpoint = '' \(default\): expected HOST:PORT .*--rdzv-endpoint"):
        load(None, cli_overrides={"nnodes": "2"})


def test_toml_mistakes_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = 1\n")
    with pytest.raises(ConfigError, match="valid TOML"):
        load(str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"optimizer = '\[optimizer\] table' \(.*unknown.toml\).*did you mean --optim\?"):
        load(str(unknown))
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[train]\nlr = 0.01\n")  # the commonest TOML slip: a key under the wrong table
    with pytest.raises(ConfigError, match=r"did you mean --optim.lr\? \(\[optim\] lr in the file\)$"):
        load(str(misplaced))
    typed = tmp_path / "typed.toml"
    typed.write_text('[train]\nepochs = "3"\n')
    with pytest.raises(ConfigError, match=r"train.epochs = '3' \(.*typed.toml\): expected an integer"):
        load(str(typed))
    with pytest.raises(ConfigError, match=r"config = '.*nope.toml' \(not found\)"):
        load(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="use one of the recipes: digits, gpt-stdlib"):
        load("digitz")


def test_global_batch_sets_accumulation_and_must_divide():
    cfg = load(None, {"data.batch_size": 8, "train.global_batch": 64})
    plan = plan_batches(cfg, world_size=2, train_size=1000)
    assert (plan.accum_steps, plan.global_batch, plan.steps_per_epoch) == (4, 64, 15)
    assert plan.describe() == "effective batch 64 = 8 per rank x 2 ranks x 4 accumulation"
    with pytest.raises(ConfigError, match=r"a multiple of data.batch_size x world size = 8 x 3 = 24.*"
                                          r"--train.global_batch=48"):
        plan_batches(cfg, world_size=3, train_size=1000)
    with pytest.raises(ConfigError, match=r"global batch \(8 x 2 x 4 = 64\) no larger than the 50"):
        plan_batches(cfg, world_size=2, train_size=50)


def test_epochs_and_max_steps():
    cfg = load(None, {"data.batch_size": 10, "train.epochs": 3})
    assert plan_batches(cfg, 2, 105).total_steps == 3 * 5
    cfg = load(None, {"data.batch_size": 10, "train.epochs": 3, "train.max_steps": 7})
    assert plan_batches(cfg, 2, 105).total_steps == 7


def test_the_library_mapping_takes_strings_as_the_cli_does_and_its_fixes_are_python() -> None:
    """fit(config={...}) used to refuse "false" for a bool with a command-line fix."""
    cfg = load(None, overrides={"train.progress": "false", "optim.lr": "3e-4", "train.epochs": "3", "nproc": 2})
    assert (cfg.train.progress, cfg.optim.lr, cfg.train.epochs, cfg.dist.nproc) == (False, 3e-4, 3, 2)
    with pytest.raises(ConfigError) as err:
        load(None, overrides={"train.progress": "maybe"})
    assert str(err.value) == ("train.progress = 'maybe' (the config mapping): expected true or false; fix: "
                              'config={"train.progress": True}')
    with pytest.raises(ConfigError, match=r'fix: config=\{"train.precision": "bf16-mixed"\}$'):
        load(None, overrides={"train.precision": "bf16"})
    with pytest.raises(ConfigError, match=r'fix: did you mean "optim.lr"\?$'):
        load(None, overrides={"optim.lrr": 0.1})
    with pytest.raises(ConfigError, match=r'optim.lr = -1.0 \(the config mapping\).*fix: config=\{"optim.lr": 0.001\}'):
        load(None, overrides={"optim.lr": -1})


def test_a_file_not_in_utf8_or_a_directory_is_one_line_and_a_bom_is_read(tmp_path):
    """A config saved as UTF-16 (Windows editors) or binary was a UnicodeDecodeError traceback; a directory was
    "not found"; UTF-8 with a byte-order mark was "invalid statement at line 1, column 1"."""
    body = "[train]\nmax_steps = 2\n"
    (tmp_path / "u16.toml").write_bytes(body.encode("utf-16"))
    (tmp_path / "bin.toml").write_bytes(bytes(range(128, 256)))
    (tmp_path / "bom.toml").write_bytes(body.encode("utf-8-sig"))
    for name, words in [("u16.toml", ["(UTF-16", "expected a TOML file in UTF-8", "fix: save it as UTF-8"]),
                        ("bin.toml", ["(not text in UTF-8)", "fix: save it as UTF-8"]),
                        ("", ["(a directory)", "fix: give the TOML file in it"])]:
        with pytest.raises(ConfigError) as info:
            load(str(tmp_path / name))
        assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    assert load(str(tmp_path / "bom.toml")).train.max_steps == 2
