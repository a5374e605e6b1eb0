"""The labs' own option checks: a number in its range, a list of sizes, no stray arguments. Each bad value is
one line naming the flag, the value, what is allowed and an example (errors.UserError: exit code 2)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from scaletrain.cli.options import parse_count
from scaletrain.errors import UserError


def parse_float(flag: str, text: str, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False, example: str) -> float:
    """``text`` as a finite number in [low, high] (an open end excludes it), else one line naming ``flag``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise UserError(f"{flag} = {text!r}: expected a number in {left}{low:g}, {high:g}{right}; "
                        f"fix: {flag} {example}")
    return value


def parse_counts(flag: str, text: str, low: int, example: str) -> list[int]:
    """A comma-separated list of integers >= ``low`` (``8,16,32``), each checked as parse_count does."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or "" in items:
        raise UserError(f"{flag} = {text!r}: expected a comma-separated list of integers >= {low}; "
                        f"fix: {flag} {example}")
    return [parse_count(flag, item, low, example) for item in items]


def refuse_leftovers(leftovers: Sequence[str], usage: str) -> None:
    """A lab takes no option it does not declare: the first stray one is the error."""
    if leftovers:
        raise UserError(f"unexpected argument {leftovers[0]!r}; fix: {usage} (see --help)")
