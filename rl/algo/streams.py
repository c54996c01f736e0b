"""Resumable dataset streams: a task's infinite train stream plus how many problems were drawn."""

from __future__ import annotations

from collections.abc import Iterator


class Cursor:
    """`next(cursor)` draws from `task.train_stream(seed_offset)`; `drawn` is the position, and
    `skip_to(n)` on a fresh cursor reproduces it (the streams are deterministic per seed)."""

    def __init__(self, task, seed_offset: int):
        self._task, self._offset = task, seed_offset
        self._it: Iterator = task.train_stream(seed_offset=seed_offset)
        self.drawn = 0

    def __iter__(self) -> "Cursor":
        return self

    def __next__(self):
        self.drawn += 1
        return next(self._it)

    def skip_to(self, n: int) -> None:
        if n < self.drawn:
            raise ValueError(f"cannot rewind a stream from {self.drawn} to {n}")
        for _ in range(n - self.drawn):
            next(self)
