"""Progress reporting for long data work, on stderr.

Contract: `Progress(description, total)` is a context manager with `advance(amount)`. On a
terminal it draws a rich progress bar; otherwise (logs, CI, pipes) it prints a plain line at
every further 10 % so logs stay short and greppable; with `enabled=False` it prints nothing.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(
        self,
        description: str,
        total: int,
        *,
        unit: str = "MB",
        scale: float = 1e6,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.description, self.total = description, max(total, 1)
        self.unit, self.scale, self.enabled = unit, scale, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._next_report = 0.1
        self._bar: object | None = None
        self._task: object | None = None

    def __enter__(self) -> Progress:
        if self.enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TextColumn(f"{{task.fields[amount]}} {self.unit}"),
                console=Console(file=self.stream),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                self.description, total=self.total, amount=self._amount()
            )
        return self

    def advance(self, amount: int) -> None:
        self.done = min(self.total, self.done + amount)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(  # type: ignore[attr-defined]
                self._task, completed=self.done, amount=self._amount()
            )
            return
        while self.done / self.total >= self._next_report - 1e-9 and self._next_report <= 1.0:
            percent = round(self._next_report * 100)
            print(
                f"{self.description}: {percent}% ({self._amount()} {self.unit})",
                file=self.stream,
                flush=True,
            )
            self._next_report += 0.1

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()  # type: ignore[attr-defined]
            self._bar = None

    def _amount(self) -> str:
        return f"{self.done / self.scale:.1f}/{self.total / self.scale:.1f}"
