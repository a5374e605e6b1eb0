"""The batch-size lab's arithmetic and checks (labs/batch_size.py, labs/batch_runs.py): the lr rules, the
micro-batch and warmup of each run, how far a setting keeps the smallest batch's metric, the sentences read
from it, and every input refused in one line before anything trains. No training here but one failing run
(patched in), which must be a row and not the end of the lab."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.errors import UserError
from scaletrain.labs import batch_runs, batch_size
from scaletrain.labs.batch_runs import Setting, peak_lr, plan_runs

LINEAR, PLAIN = Setting("linear", 2.0), Setting("none", 0.0)


def test_peak_lr_rules():
    assert peak_lr("linear", 0.05, 256, 32) == pytest.approx(0.4)  # Goyal et al.: x k
    assert peak_lr("sqrt", 0.05, 128, 32) == pytest.approx(0.1)  # x sqrt(k)
    assert peak_lr("none", 0.05, 1024, 32) == 0.05


def test_setting_names():
    assert LINEAR.name == "linear + 2 ep warmup"
    assert PLAIN.name == "no rule"


@pytest.mark.parametrize("text, batches", [("32,256", [32, 256]), ("256, 32,32,64", [32, 64, 256])])
def test_parse_batches_sorts_and_drops_repeats(text, batches):
    assert batch_size.parse_batches(text) == batches


@pytest.mark.parametrize("text, words", [
    ("32,abc", ["--batches = 'abc'", "fix: --batches 32,64,128,256"]),
    ("32,-1", ["--batches = '-1'", ">= 1"]),
    ("32,", ["--batches = '32,'", "comma-separated"]),
    ("32", ["at least two global batches", "fix: --batches 32,256"]),
    ("64,64", ["at least two global batches"]),
])
def test_parse_batches_refuses(text, words):
    with pytest.raises(UserError) as err:
        batch_size.parse_batches(text)
    for word in words:
        assert word in str(err.value)


def test_warmup_is_epochs_defaulting_to_a_tenth():
    assert batch_size.parse_warmup(None, 20) == 2.0
    assert batch_size.parse_warmup("0.5", 20) == 0.5
    for bad in ("-1", "21", "two", "nan"):
        with pytest.raises(UserError, match="--warmup"):
            batch_size.parse_warmup(bad, 20)


def test_micro_batch_is_the_largest_divisor_that_fits():
    assert batch_runs._micro(256, 1, 32) == 32  # 8 micro-steps of 32
    assert batch_runs._micro(96, 1, 64) == 48  # 64 does not divide 96: 2 of 48
    assert batch_runs._micro(16, 2, 32) == 8  # smaller than data.batch_size: one step of 8 per rank
    with pytest.raises(UserError, match="not a multiple of --nproc 2"):
        batch_runs._micro(33, 2, 32)


@pytest.mark.parametrize("key", sorted(batch_runs.LAB_KEYS))
def test_keys_the_lab_sets_are_refused(key):
    with pytest.raises(UserError) as err:
        batch_runs.check_overrides({key: "1"})
    assert f"--{key} = '1'" in str(err.value) and "fix: drop it and use" in str(err.value)


def test_plan_digits(tmp_path):
    """digits: 1,437 training samples; lr 0.05 at base_batch 64 with the linear rule on -> 0.025 at 32."""
    base, train_size, specs = plan_runs("digits", {}, [32, 256], [LINEAR, PLAIN], tmp_path)
    assert train_size == 1437 and base.optim.lr == 0.05
    by = {(s.setting, s.batch): s for s in specs}
    small, big, plain = by[LINEAR, 32], by[LINEAR, 256], by[PLAIN, 256]
    assert (small.lr, small.warmup_steps, small.steps) == (0.025, 0, 20 * 44)
    assert big.lr == pytest.approx(0.2) and big.warmup_steps == 2 * 5 and big.steps == 20 * 5
    assert big.micro == 32 and big.overrides["train.global_batch"] == "256"
    assert big.overrides["schedule.warmup_start"] == str(0.025 / big.lr)  # Goyal et al. start from lr0
    assert (plain.lr, plain.warmup_steps) == (0.025, 0)
    assert small.dir == by[PLAIN, 32].dir  # the same computation: one run
    assert big.dir.name == "b0256-lr0.2-w10" and plain.dir.name == "b0256-lr0.025-w0"
    assert small.overrides["data.eval_batch_size"] == big.overrides["data.eval_batch_size"] == "32"


def test_a_configs_own_max_steps_is_not_used_and_said(tmp_path, capsys):
    """A file's (or a recipe's) train.max_steps gave every batch the same steps, while the lab's header and
    reading spoke of epochs: every run trains the epochs now, and the note says the file's value is unused."""
    toml = tmp_path / "mine.toml"
    toml.write_text('[data]\nsource = "digits"\n[model]\nname = "mlp"\n[train]\nmax_steps = 5\nepochs = 2\n', encoding="utf-8")
    _, _, specs = plan_runs(str(toml), {}, [32, 128], [PLAIN], tmp_path / "lab")
    assert sorted(s.steps for s in specs) == [2 * (1437 // 128), 2 * (1437 // 32)]
    assert all(s.overrides["train.max_steps"] == "0" for s in specs)
    assert "train.max_steps = 5 of " in capsys.readouterr().err


def test_plan_refuses_a_batch_larger_than_the_data(tmp_path):
    with pytest.raises(UserError, match="4096 is larger than the 1,437 training samples of digits"):
        plan_runs("digits", {}, [32, 4096], [LINEAR], tmp_path)


def test_plan_refuses_a_directory_of_another_run(tmp_path):
    _, _, specs = plan_runs("digits", {}, [32, 64], [LINEAR], tmp_path)
    specs[1].dir.mkdir()
    (specs[1].dir / batch_runs.MARK).write_text(json.dumps({"digest": "0" * 16}))
    with pytest.raises(UserError, match="holds a run of another configuration"):
        plan_runs("digits", {}, [32, 64], [LINEAR], tmp_path)
    (specs[1].dir / batch_runs.MARK).write_text(json.dumps({"digest": specs[1].digest}))
    plan_runs("digits", {}, [32, 64], [LINEAR], tmp_path)  # its own: reused or resumed


def _runs(values: dict[int, float | None]) -> list[dict]:
    return [{"batch": b, "eval": {} if v is None else {"accuracy": v}} for b, v in values.items()]


def test_holds_up_to_the_last_batch_within_tolerance():
    runs = _runs({32: 0.958, 128: 0.955, 256: 0.950, 512: 0.90, 1024: 0.957})
    held = batch_size._holds(runs, "accuracy", 1)
    assert held == {"reference": 0.958, "holds_up_to": 256, "breaks_at": 512}
    assert batch_size._holds(runs, "accuracy", 0.5)["holds_up_to"] == 128
    failed = _runs({32: 0.958, 128: None, 256: 0.957})
    assert batch_size._holds(failed, "accuracy", 1)["breaks_at"] == 128  # a failed run breaks it
    assert batch_size._holds(_runs({32: None, 64: 0.9}), "accuracy", 1)["holds_up_to"] is None


def test_loss_tolerance_is_relative():
    runs = [{"batch": 32, "eval": {"loss": 2.0}}, {"batch": 64, "eval": {"loss": 2.019}},
            {"batch": 128, "eval": {"loss": 2.03}}]
    assert batch_size._metric(runs) == "loss"
    assert batch_size._holds(runs, "loss", 1)["holds_up_to"] == 64


def _numbers(rule=(0.9583, 0.9556, 0.8861), plain=(0.9583, 0.8861, 0.6722)) -> dict:
    """The MLP lab of tests/cli/test_lab_batch_size_cli.py (seed 0): accuracies at batches 32, 256, 1024;
    None for a run that failed."""
    runs = []
    for setting, lrs, accs in ((LINEAR, (0.05, 0.4, 1.6), rule), (PLAIN, (0.05, 0.05, 0.05), plain)):
        for batch, lr, acc, steps in zip((32, 256, 1024), lrs, accs, (880, 100, 20)):
            runs.append({"batch": batch, "setting": setting.name, "lr": lr, "warmup_steps": 0, "steps": steps,
                         "samples": steps * batch, "wall_s": 0.5, "reused": False,
                         "failed": "non-finite loss" if acc is None else None, "dir": f"b{batch}-{lr}",
                         "eval": {} if acc is None else {"accuracy": acc, "loss": 0.1}})
    return batch_size._numbers("digits", 1437, 1, 20, 1.0, [LINEAR, PLAIN], runs)


def test_reading_says_where_the_rule_holds_breaks_and_what_it_buys():
    numbers = _numbers()
    assert [s["holds_up_to"] for s in numbers["settings"]] == [256, 32]
    text = " ".join(batch_size._reading(numbers))
    assert "stays within 1 point of batch 32's 95.83% up to batch 256 (95.56% in 100 steps instead" in text
    assert "It breaks at batch 1024: 88.61% (vs batch 32's 95.83%) at lr 1.6 in 20 steps" in text
    assert "Without a rule (lr 0.05 at every batch, no warmup), batch 256 reaches 88.61% (vs 95.56%" in text
    assert "8,192 of 1.28M images" in text and "batch 256 is 18% of the 1,437 training samples" in text
    rows = dict(batch_size._rows(numbers))
    assert rows["linear + 2 ep warmup: kept up to"] == "batch 256"


def test_reading_when_the_rule_never_holds_or_a_run_fails():
    text = " ".join(batch_size._reading(_numbers(rule=(0.9583, 0.93, 0.90))))
    assert "linear + 2 ep warmup: already at batch 256 it is more than 1 point off: 93.00%" in text
    assert "Here batch 256 is already 18% of the 1,437 training samples" in text
    assert "Without a rule" not in text and "no rule: already at batch 256" in text
    text = " ".join(batch_size._reading(_numbers(rule=(0.9583, 0.9556, None))))
    assert "It breaks at batch 1024: the run failed at lr 1.6: non-finite loss." in text
    assert "1 run(s) failed" in text


def test_a_run_that_raises_is_a_failed_row_and_the_lab_goes_on(tmp_path, monkeypatch, capsys):
    """Any exception in one run (here a RuntimeError patched into the batch-64 run) is that run's row."""
    def fake(spec, recipe):
        if spec.batch == 64:
            raise RuntimeError("boom\nsecond line")
        summary = {"steps": 1437 // spec.batch, "epochs": 1.0, "samples": 1437 // spec.batch * spec.batch,
                   "wall_s": 0.1, "accum_steps": 1, "train_loss": 1.0, "eval": {"accuracy": 0.5, "loss": 1.0}}
        (spec.dir / "summary.json").write_text(json.dumps(summary))
        return ""

    monkeypatch.setattr(batch_runs, "_in_process", fake)
    code = batch_size.run(_args(["digits", "--batches", "32,64,128", "--no-compare", "--train.epochs=1",
                                 "--out", str(tmp_path)]), [])
    assert code == 0
    lab = json.loads((tmp_path / "lab.json").read_text())
    failed = {r["batch"]: r["failed"] for r in lab["numbers"]["runs"]}
    assert failed == {32: None, 64: "RuntimeError: boom", 128: None}
    assert lab["numbers"]["settings"][0]["breaks_at"] == 64
    assert "1 run(s) failed" in " ".join(lab["reading"])
    assert sorted(lab["figures"]) == ["curves.png", "metric_vs_batch.png"]
    assert "failed: RuntimeError: boom" in capsys.readouterr().out


def _args(argv: list[str]):
    from scaletrain.cli.options import Parser

    parser = Parser(prog="scaletrain lab", allow_abbrev=False)
    batch_size.add_parser(parser.add_subparsers(dest="lab", parser_class=Parser), "batch-size")
    args, leftovers = parser.parse_known_args(["batch-size", *argv])
    assert not leftovers
    return args


def test_sqrt_rule_plans_sqrt_lrs(tmp_path):
    _, _, specs = plan_runs("digits", {}, [32, 128], [Setting("sqrt", 1.0)], tmp_path)
    assert [s.lr for s in specs] == [0.025, pytest.approx(0.025 * math.sqrt(4))]
    assert [s.dir.name for s in specs] == ["b0032-lr0.025-w0", "b0128-lr0.05-w11"]
