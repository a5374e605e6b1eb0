"""What the bench commands parse and compute: sizes, lists, and nccl-tests' bandwidth arithmetic.

Pure functions, unit-tested. A bad value raises ConfigError naming the flag, the value, what is allowed and
the fix, which the CLI prints as one line with exit code 2.

Units: sizes are bytes with binary multiples (1KB = 1024 bytes, as nccl-tests' -b/-e flags read them);
bandwidths are bytes per second, printed in GB/s with GB = 1e9 bytes (as nccl-tests prints them).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from scaletrain.errors import ConfigError

_MULTIPLIERS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
                "g": 2**30, "gb": 2**30, "gib": 2**30}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
SIZE_FORMS = "sizes like 1KB, 256MB, 1GB (1KB = 1024 bytes), a list 1KB,64KB, or a doubling range 1KB..256MB"

# nccl-tests (doc/PERFORMANCE.md): busbw = algbw x factor, the factor making busbw comparable to the
# hardware's link bandwidth whatever the rank count.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor(op: str, world: int) -> float:
    """all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n; broadcast 1."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise AssertionError(f"unknown collective {op}")


def algbw(size_bytes: int, time_s: float) -> float:
    """Algorithm bandwidth in bytes/s: the full buffer's size over the time (nccl-tests' algbw)."""
    return size_bytes / time_s


def busbw(op: str, size_bytes: int, time_s: float, world: int) -> float:
    """Bus bandwidth in bytes/s (nccl-tests' busbw): algbw x the op's factor for ``world`` ranks."""
    return algbw(size_bytes, time_s) * bus_factor(op, world)


def parse_size(text: str, flag: str = "--sizes") -> int:
    """'1KB' -> 1024, '256MB' -> 268435456, '512' -> 512 (bytes); case-insensitive, K/KB/KiB alike."""
    match = _SIZE.fullmatch(text.strip().lower())
    mult = _MULTIPLIERS.get(match.group(2)) if match else None
    if match is None or mult is None:
        raise ConfigError(flag, text, SIZE_FORMS, f"{flag} 1KB..256MB")
    size = float(match.group(1)) * mult
    if size < 1 or size != int(size):
        raise ConfigError(flag, text, "a whole number of bytes >= 1", f"{flag} 1KB..256MB")
    return int(size)


def parse_sizes(text: str, flag: str = "--sizes") -> list[int]:
    """'1KB..8KB' -> [1024, 2048, 4096, 8192]; 'a..b' doubles from a while <= b; commas join items.
    Returns the distinct sizes, ascending."""
    sizes: set[int] = set()
    for item in text.split(","):
        lo_text, dots, hi_text = item.partition("..")
        lo = parse_size(lo_text, flag)
        if not dots:
            sizes.add(lo)
            continue
        hi = parse_size(hi_text, flag)
        if hi < lo:
            raise ConfigError(flag, text, f"a range a..b with a <= b ({item} runs backwards)",
                              f"{flag} {hi_text.strip()}..{lo_text.strip()}")
        while lo <= hi:
            sizes.add(lo)
            lo *= 2
    return sorted(sizes)


def format_size(size: int) -> str:
    """1024 -> '1KB', 3 x 2**20 -> '3MB', 1536 -> '1.5KB' (binary multiples, as parse_size reads them)."""
    for unit, mult in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= mult:
            return f"{size / mult:.4g}{unit}"
    return f"{size}B"


def parse_ints(text: str, flag: str, *, minimum: int = 1, example: str = "1,2,4") -> list[int]:
    """'1,2,4' -> [1, 2, 4] (order kept, duplicates dropped); each an integer >= minimum."""
    values: list[int] = []
    for item in text.split(","):
        try:
            value = int(item.strip().replace("_", ""))
        except ValueError:
            raise ConfigError(flag, text, f"comma-separated integers >= {minimum}", f"{flag} {example}") from None
        if value < minimum:
            raise ConfigError(flag, text, f"integers >= {minimum} ({value} is not)", f"{flag} {example}")
        if value not in values:
            values.append(value)
    return values


def parse_int(text: str | int, flag: str, *, minimum: int = 1, example: str = "") -> int:
    """One integer >= minimum."""
    values = parse_ints(str(text), flag, minimum=minimum, example=example or str(max(minimum, 1)))
    if len(values) != 1:
        raise ConfigError(flag, text, f"one integer >= {minimum}", f"{flag} {example or max(minimum, 1)}")
    return values[0]


def parse_names(text: str, flag: str, allowed: Sequence[str], *, everything: str = "all") -> list[str]:
    """'all_reduce,broadcast' -> those names, in the order given; ``everything`` means all of ``allowed``."""
    if text.strip() == everything:
        return list(allowed)
    names: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if item not in allowed:
            close = difflib.get_close_matches(item, allowed, n=1)
            fix = f"{flag} {close[0]}" if close else f"{flag} {everything}"
            raise ConfigError(flag, text, f"{everything} or a comma-separated list of {', '.join(allowed)} "
                              f"({item!r} is not one)", fix)
        if item not in names:
            names.append(item)
    return names


def parse_choice(text: str, flag: str, allowed: Sequence[str]) -> str:
    """Exactly one of ``allowed``."""
    value = text.strip()
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=1)
        raise ConfigError(flag, text, f"one of {', '.join(allowed)}", f"{flag} {close[0] if close else allowed[0]}")
    return value
