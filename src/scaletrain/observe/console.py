"""Rank 0's voice: log lines, a progress bar on terminals, a summary table. Other ranks print nothing."""

from __future__ import annotations

from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class Console:
    def __init__(self, enabled: bool, progress: bool = True) -> None:
        self.enabled = enabled
        self._rich = RichConsole(highlight=False, soft_wrap=True)
        self._bar: Progress | None = None
        self._task: Any = None
        self._want_bar = enabled and progress and self._rich.is_terminal

    def print(self, message: str) -> None:
        if self.enabled:
            (self._bar.console if self._bar else self._rich).print(message, markup=False)

    def start_progress(self, total: int, done: int = 0) -> None:
        if not self._want_bar:
            return
        self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                             TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=self._rich,
                             transient=True)
        self._task = self._bar.add_task("train", total=total, completed=done, status="")
        self._bar.start()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1)

    def status(self, text: str) -> None:
        """Text shown after the bar (the last logged loss)."""
        if self._bar is not None:
            self._bar.update(self._task, status=text)

    def stop_progress(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def table(self, title: str, rows: list[tuple[str, str]]) -> None:
        if not self.enabled:
            return
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column(justify="right")
        for name, value in rows:
            table.add_row(name, value)
        self._rich.print(table)
