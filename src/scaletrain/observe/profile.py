"""--debug.profile FIRST-LAST: torch.profiler over a window of optimizer steps, every rank.

The profiler starts as step FIRST begins and stops as step LAST ends (a session's steps, counted from 1 over the
whole run: a resumed run profiles the window if it has not passed), recording CPU ops and, on a GPU, CUDA
kernels and memory. Each rank writes RUN_DIR/profile/rank-NNNNN.json (a Chrome trace: ui.perfetto.dev) and
rank-NNNNN.txt (the ops by total time, torch's key_averages table). Nothing is recorded outside the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class StepProfiler:
    def __init__(self, run_dir: Path, rank: int, window: tuple[int, int], device: torch.device) -> None:
        self.first, self.last = window
        self.out = run_dir / "profile"
        self.rank, self.device = rank, device
        self._prof: Any = None
        self.written: list[Path] = []

    def before(self, step: int) -> None:
        """Step ``step`` begins."""
        if step == self.first and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities, profile_memory=True, record_shapes=True)
            self._prof.__enter__()

    def after(self, step: int) -> None:
        """Step ``step`` ended (the profile stops after LAST, or at close)."""
        if self._prof is not None and step >= self.last:
            self.stop()

    def stop(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"rank-{self.rank:05d}.json"
        prof.export_chrome_trace(str(trace))
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        table = self.out / f"rank-{self.rank:05d}.txt"
        table.write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n", encoding="utf-8")
        self.written = [trace, table]
