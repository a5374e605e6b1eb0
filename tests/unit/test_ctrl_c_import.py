"""A Ctrl-C while the CLI imports torch or numpy waits for the module to be whole, then is the usual
KeyboardInterrupt (main() says "scaletrain: interrupted", exit 130): not SIGABRT from inside torch's C++
initialisation, nor a half-imported numpy that a later import trips over."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap


def _as_at_a_terminal() -> None:
    """Ctrl-C's default handling in the child, as at a terminal: a suite started in the background (`make test
    &`) passes SIGINT on ignored, and Python keeps it so (both tests then saw no interrupt at all)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_ctrl_c_inside_a_held_import_is_raised_after_the_module_is_whole(tmp_path):
    (tmp_path / "slow_module.py").write_text(textwrap.dedent("""
        import os, signal, sys
        sys.steps.append("before")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of this module's import
        sys.steps.append("after")
    """))
    script = textwrap.dedent("""
        import sys
        from scaletrain.cli import _CtrlCAfterImport
        finder = _CtrlCAfterImport()
        finder.HELD = ("slow_module",)
        sys.meta_path.insert(0, finder)
        sys.steps = []
        try:
            import slow_module
        except KeyboardInterrupt:
            print("interrupted after", *sys.steps)
        else:
            print("no interrupt")
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         preexec_fn=_as_at_a_terminal)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "interrupted after before after"


def test_without_the_finder_the_same_import_stops_half_way(tmp_path):
    """The control: Python's own Ctrl-C raises inside the module, leaving it without AFTER."""
    (tmp_path / "slow_module.py").write_text("import os, signal, sys\nsys.steps.append('before')\n"
                                             "os.kill(os.getpid(), signal.SIGINT)\nsys.steps.append('after')\n")
    script = ("import sys\nsys.steps = []\ntry:\n    import slow_module\nexcept KeyboardInterrupt:\n"
              "    print('interrupted after', *sys.steps)\n")
    out = subprocess.run([sys.executable, "-c", script], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         preexec_fn=_as_at_a_terminal)
    assert out.stdout.strip() == "interrupted after before", out.stderr


def test_main_installs_it_once_and_torch_imports_through_it(tmp_path):
    script = textwrap.dedent("""
        import sys
        from scaletrain.cli import _CtrlCAfterImport, main
        main(["train", "digits", "--optim.lrr=0.1"])
        main(["train", "digits", "--optim.lrr=0.1"])
        import torch, numpy
        finders = [f for f in sys.meta_path if isinstance(f, _CtrlCAfterImport)]
        print(len(finders), type(torch.__spec__.loader).__name__, torch.tensor([1.0, 2.0]).sum().item())
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1 _CtrlCAfterImport 3.0"
