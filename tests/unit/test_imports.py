"""What a command imports decides how long it takes to start (torch alone is ~1.5 s here): the CLI's parser,
`--help`, and the planner's catalog must not import torch; the trainer imports neither matplotlib (the report's
charts) nor torch's DTensor stack (FSDP, tensor parallelism, DCP) to start a run that does not shard."""

from __future__ import annotations

import subprocess
import sys


def _imported(code: str, *modules: str) -> list[str]:
    """Which of ``modules`` a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(*[m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1].split() if out.stdout.strip() else []


def _imports_torch(code: str) -> bool:
    return _imported(code, "torch") == ["torch"]


def test_building_the_cli_and_the_plan_catalog_does_not_import_torch() -> None:
    assert not _imports_torch("from scaletrain.cli import build_parser; build_parser()")
    assert not _imports_torch("import scaletrain.plan.catalog, scaletrain.observe.peaks")
    assert _imports_torch("import scaletrain.observe.throughput")  # the probe itself can tell


def test_a_config_mistake_and_the_slurm_script_cost_no_torch_import() -> None:
    """A mistake in `scaletrain train` is found before torch is imported; `scaletrain slurm` never needs it."""
    assert not _imports_torch("from scaletrain.cli import main; main(['train', 'digits', '--optim.lrr=0.1'])")
    assert not _imports_torch("from scaletrain.cli import main; main(['slurm', 'digits', '--nodes', '2', "
                              "'--gpus-per-node', '8', '--time', '10'])")


def test_the_trainers_modules_import_no_charts_and_no_dtensor() -> None:
    """Everything `scaletrain train` and fit() import to start: 0.4 s of matplotlib (the report's loader shared a
    package with its charts) and 0.5 s of DTensor were ~20% of a short run's start. torch's dynamo imports
    DTensor itself once an optimizer or a dispatch mode first runs; a run that never shards never needs it
    earlier, and no DTensor exists before its module does (scaletrain/sharded.py)."""
    heavy = ("matplotlib", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
    code = "import scaletrain.train.run, scaletrain.train.session, scaletrain.parallel, scaletrain.observe.report.load"
    assert _imported(code, "torch", *heavy) == ["torch"]
    assert _imported("import scaletrain.parallel.fsdp", *heavy)  # the probe itself can tell
