"""What a command imports decides how long it takes to start (torch alone is ~1.5 s here): the CLI's parser,
`--help`, and the planner's catalog must not import torch."""

from __future__ import annotations

import subprocess
import sys


def _imports_torch(code: str) -> bool:
    probe = f"{code}\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_building_the_cli_and_the_plan_catalog_does_not_import_torch() -> None:
    assert not _imports_torch("from scaletrain.cli import build_parser; build_parser()")
    assert not _imports_torch("import scaletrain.plan.catalog, scaletrain.observe.peaks")
    assert _imports_torch("import scaletrain.observe.throughput")  # the probe itself can tell


def test_a_config_mistake_and_the_slurm_script_cost_no_torch_import() -> None:
    """A mistake in `scaletrain train` is found before torch is imported; `scaletrain slurm` never needs it."""
    assert not _imports_torch("from scaletrain.cli import main; main(['train', 'digits', '--optim.lrr=0.1'])")
    assert not _imports_torch("from scaletrain.cli import main; main(['slurm', 'digits', '--nodes', '2', "
                              "'--gpus-per-node', '8', '--time', '10'])")
