"""User-facing errors: each becomes one line on stderr and exit code 2, never a traceback.

Internal invariants use ``assert``; anything a user can cause by their input (a config key, a value,
a file) raises one of these with what was wrong, what is allowed and how to fix it.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1  # training failed (a crash, a non-finite loss)
EXIT_USAGE = 2  # usage or configuration error


class TrainingFailed(Exception):
    """Training cannot go on (exit code 1): a non-finite loss, a failed collective, out of memory."""


class UserError(Exception):
    """A mistake in the user's input. ``str(err)`` is the whole one-line message."""


class ConfigError(UserError):
    """A config key or value that cannot be used."""

    def __init__(self, key: str, value: Any, expected: str, fix: str, origin: str = "") -> None:
        where = f" ({origin})" if origin else ""
        super().__init__(f"{key} = {value!r}{where}: expected {expected}; fix: {fix}")
        self.key, self.value, self.expected, self.fix = key, value, expected, fix

    def at(self, origin: str) -> ConfigError:
        """The same error, saying where the value came from."""
        return ConfigError(self.key, self.value, self.expected, self.fix, origin)


class DataError(UserError):
    """A data file or directory that is missing or malformed."""

    def __init__(self, path: Any, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}; fix: {fix}")
        self.path = path


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, damaged, tampered with, or for another model."""

    def __init__(self, path: Any, problem: str, fix: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}; fix: {fix}")
        self.path, self.problem = path, problem
