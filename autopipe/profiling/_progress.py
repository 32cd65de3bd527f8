"""A one-line progress bar on stderr, so a minutes-long profile shows that it is moving."""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts steps up to ``total`` and redraws one line; silent when ``enabled`` is false.

    Redraws at most every 0.1 s because a chain of small layers finishes thousands of steps.
    """

    WIDTH = 30

    def __init__(self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._drawn = 0.0
        self._start = time.perf_counter()

    def step(self, detail: str = "") -> None:
        """One step done; ``detail`` names it (e.g. the layer and micro-batch size)."""
        self.done = min(self.done + 1, self.total)
        now = time.perf_counter()
        if self.enabled and (now - self._drawn >= 0.1 or self.done == self.total):
            self._drawn = now
            filled = self.WIDTH * self.done // self.total
            bar = "#" * filled + "." * (self.WIDTH - filled)
            elapsed = now - self._start
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {detail:<28.28}")
            self.stream.flush()

    def close(self) -> None:
        """End the line so the next output starts on its own."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
