"""Fault injection from the [chaos] config section: rehearse a killed, hung, slow, NaN-producing, preempted or
Ctrl-C'd rank.

Off by default; every hook is a cheap integer comparison when off. A kill, hang or signal fires on the job's
first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT = 0), so that a restarted group gets past it as a
real job gets past a one-off failure.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from scaletrain.config import ChaosConfig
from scaletrain.env import under_launcher


class Chaos:
    def __init__(self, cfg: ChaosConfig, rank: int, world: int) -> None:
        cfg.check_world(world)  # a rank beyond the world would silently never fire
        self.cfg, self.rank = cfg, rank
        self.first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        self.delay_s = cfg.delay_ms / 1000 if cfg.delay_rank == rank else 0.0

    def before_step(self, step: int) -> None:
        """``step`` is the 1-based step about to run."""
        cfg = self.cfg
        if not self.first_attempt:
            return
        if cfg.kill_rank == self.rank and cfg.kill_step == step:
            print(f"[rank {self.rank}] chaos: SIGKILL (pid {os.getpid()}) at the start of step {step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.signal_rank == self.rank and cfg.signal_step == step:
            self._signal(step)
        if cfg.hang_rank == self.rank and cfg.hang_step == step:
            print(f"[rank {self.rank}] chaos: hanging for {cfg.hang_s:g} s at the start of step {step}",
                  file=sys.stderr, flush=True)
            time.sleep(cfg.hang_s)

    def _signal(self, step: int) -> None:
        sig = signal.Signals[self.cfg.signal_name]
        if sig != signal.SIGINT:
            print(f"[rank {self.rank}] chaos: {sig.name} at the start of step {step}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), sig)
            return
        # A terminal's Ctrl-C reaches its foreground process group: the launcher's (torchrun starts each
        # worker in a session of its own: the workers hear of it from the launcher), or this process's.
        group = os.getpgid(os.getppid()) if under_launcher() else os.getpgrp()
        print(f"[rank {self.rank}] chaos: SIGINT (Ctrl-C) to process group {group} at the start of step "
              f"{step}", file=sys.stderr, flush=True)
        os.killpg(group, sig)

    def delay(self, phase: str) -> None:
        if self.delay_s and self.cfg.delay_phase == phase:
            time.sleep(self.delay_s)

    def poisons(self, step: int) -> bool:
        """chaos.nan_rank / nan_step: this rank's loss is NaN at this step."""
        return self.cfg.nan_rank == self.rank and self.cfg.nan_step == step

    def poison(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self.poisons(step) else loss

    def interrupt_after(self, step: int) -> bool:
        return self.cfg.interrupt_step == step
