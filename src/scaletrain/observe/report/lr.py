"""The learning rate a run used at every step, rebuilt from what the run recorded, for the report's LR chart.

metrics.jsonl logs the lr only every log.every steps: too coarse to show a short warmup, and it makes a cosine
look piecewise linear. The schedule itself is a pure function of the run's config, computed by the code
the trainer's LambdaLR calls (scaletrain.schedule): config.toml's [schedule], and summary.json's peak_lr
(after the linear scaling rule) and steps, which is the run's total because summary.json is written only
when the run reached its last step. The logged lr is the measurement, drawn over the curve; where the two disagree (a run
resumed with another global batch or schedule changed its plan midway), no curve is drawn and the chart says
why.
"""

from __future__ import annotations

import math
from typing import Any

from scaletrain.config import ScheduleConfig, build
from scaletrain.errors import ConfigError
from scaletrain.observe.report.load import CONFIG, SUMMARY, Run
from scaletrain.schedule import WarmupDecay

MAX_POINTS = 2000  # a point per step up to here; beyond, every k-th step (finer than the figure's pixels)


def _schedule(config: dict[str, Any]) -> ScheduleConfig:
    section = config.get("schedule")
    if not isinstance(section, dict):
        raise ConfigError("schedule", section, "a [schedule] table", "the config.toml that the run wrote")
    return build([(CONFIG, {f"schedule.{key}": value for key, value in section.items()})]).schedule


def _recorded(run: Run) -> tuple[WarmupDecay, float, int] | str:
    """(the schedule's factor, peak lr, total steps), or why they cannot be had from the run's files."""
    if run.config is None:
        return f"no {CONFIG}"
    if run.summary is None:
        return f"no {SUMMARY}: the run has not finished, so its total steps are not known"
    peak, total = run.summary.get("peak_lr"), run.summary.get("steps")
    if not isinstance(peak, (int, float)) or not isinstance(total, int) or total < 1:
        return f"{SUMMARY} has no peak_lr and steps"
    try:
        return WarmupDecay(_schedule(run.config), total), float(peak), total
    except ConfigError as err:
        return f"{CONFIG}'s [schedule] does not load here: {err}"


def planned_lr(run: Run) -> tuple[list[int], list[float], str]:
    """(steps, the lr after each, "") for the schedule the run used, from step 0 to its last; ([], [], why)
    when the run did not record enough to rebuild it, or its logged lr is not that schedule's."""
    got = _recorded(run)
    if isinstance(got, str):
        return [], [], got
    factor, peak, total = got
    for record in run.train:
        # LambdaLR's arithmetic, base_lr * lambda(step): the very float the trainer's optimizer held.
        planned = peak * factor(record["step"])
        if "lr" in record and not math.isclose(record["lr"], planned, rel_tol=1e-9, abs_tol=1e-12 * peak):
            return [], [], (f"the lr logged at step {record['step']} ({record['lr']:.6g}) is not the "
                            f"schedule's ({planned:.6g}): the plan changed midway, e.g. a resume with another "
                            "global batch")
    stride = math.ceil(total / MAX_POINTS)
    steps = list(range(0, total + 1, stride))
    if steps[-1] != total:
        steps.append(total)
    return steps, [peak * factor(s) for s in steps], ""
