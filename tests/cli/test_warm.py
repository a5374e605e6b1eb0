"""The suite's warm interpreter (tests/warm.py) runs a script as a new interpreter would: the tests that start
scripts, and scaletrain's workers of scripts, through it are only as true as this."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from warm import PYTHON, SOCKET_ENV

# What a script can see of how it was started; "preloaded" tells a fork of the warm interpreter (torch imported
# already) from a new one.
PROBE = """\
import json, os, sys
preloaded = "torch" in sys.modules
import torch
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
                  "file": __file__, "mine": os.environ.get("PROBE_VALUE"), "threads": torch.get_num_threads(),
                  "preloaded": preloaded}))
sys.stdout.flush()
if sys.argv[1:] == ["raise"]:
    def inner():
        raise ValueError("from the probe")
    inner()
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""

pytestmark = pytest.mark.skipif(os.environ.get(SOCKET_ENV, "0") == "0",
                                reason="the suite runs without its warm interpreter (SCALETRAIN_TEST_WARM=0)")


def _run(argv: list[str], cwd: Path, *, warm: bool = True) -> tuple[int, dict, str]:
    env = {**os.environ, "PROBE_VALUE": "seen", "OMP_NUM_THREADS": "1"}
    if not warm:
        env[SOCKET_ENV] = "0"
    proc = subprocess.run([*PYTHON, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    seen = json.loads(proc.stdout.splitlines()[0]) if proc.stdout.startswith("{") else {"stdout": proc.stdout}
    return proc.returncode, seen, proc.stderr


def test_a_script_and_a_module_run_warm_as_a_new_interpreter_runs_them(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "broken.py").write_text("print('never')\ndef (\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for argv, cwd in (([str(tmp_path / "pkg" / "probe.py"), "3"], elsewhere),
                      (["-u", os.path.join("..", "pkg", "probe.py"), "raise"], elsewhere),
                      (["-m", "pkg.probe", "4"], tmp_path),
                      (["-u", "-m", "pkg.probe", "raise"], tmp_path),
                      (["../pkg/broken.py"], elsewhere)):
        (code, warm, err), (cold_code, cold, cold_err) = _run(argv, cwd), _run(argv, cwd, warm=False)
        if "broken" not in argv[0]:
            assert (warm.pop("preloaded"), cold.pop("preloaded")) == (True, False), argv  # one of each
        assert (code, warm, err) == (cold_code, cold, cold_err), argv
        if argv[-1] == "raise":
            assert (code, warm["name"], err.splitlines()[-1]) == (1, "__main__", "ValueError: from the probe")
    assert (code, err.splitlines()[-1]) == (1, "SyntaxError: invalid syntax")  # and no traceback, as Python says it
    code, seen, _ = _run(["-u", os.path.join("..", "pkg", "probe.py"), "3"], elsewhere)  # as Python has them:
    assert (code, seen["argv"], seen["file"], seen["path0"]) == \
        (3, ["../pkg/probe.py", "3"], str(elsewhere / ".." / "pkg" / "probe.py"), str(tmp_path / "pkg"))


def test_what_a_fork_would_not_be_runs_in_a_new_interpreter(tmp_path: Path) -> None:
    """Python's other options, and a resource limit the warm interpreter does not have, start a new one."""
    (tmp_path / "probe.py").write_text(PROBE)
    code, seen, _ = _run(["-c", "import sys; print(sys.argv, 'torch' in sys.modules)"], tmp_path)
    assert (code, seen) == (0, {"stdout": "['-c'] False\n"})
    code, seen, _ = _run(["probe.py", "5"], tmp_path)
    assert (code, seen["preloaded"]) == (5, True)
    limited = subprocess.run(["bash", "-c", f"ulimit -S -n 512 && exec {' '.join(PYTHON)} probe.py 5"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, check=False)
    assert (limited.returncode, json.loads(limited.stdout)["preloaded"]) == (5, False), limited.stderr
