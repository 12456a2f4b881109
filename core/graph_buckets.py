"""What decode graphs and graph pieces share: sizes captured once each, a step padded to the
smallest that holds it, static input buffers whose rows past the step go back to padding, and
capturing every size before a server's first request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class GraphBuckets(ABC):
    """Captured replays keyed by size (requests or tokens); subclasses capture and pad."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = tuple(sorted(sizes))
        self.captured: dict[int, Any] = {}  # size -> what replays it
        self.replays = dict.fromkeys(self.sizes, 0)  # per size, for tests and the GPU check
        self.unavailable: str | None = None  # set when the platform declined to capture
        self._loaded = 0  # rows the last step filled (past them the buffers hold padding)

    @abstractmethod
    def _capture(self, size: int) -> Any | None:
        """Capture ``size`` into :attr:`captured` and return it; None (and :attr:`unavailable`
        set) where the platform declined."""

    @abstractmethod
    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` of the input buffers as padding."""

    def size_for(self, rows: int) -> int | None:
        """The smallest size that holds ``rows``, or None."""
        return next((s for s in self.sizes if s >= rows), None)

    def capture_all(self) -> int:
        """Capture every size not captured yet, largest first (the smaller ones then reuse its
        memory); returns how many. A server calls it before its first request, which would
        otherwise wait for the captures its batches need."""
        todo = [s for s in reversed(self.sizes) if s not in self.captured]
        for size in todo:
            if self._capture(size) is None:
                return 0
        return len(todo)

    def _replay_for(self, rows: int) -> tuple[int, Any] | None:
        """(size, its replay) for a step of ``rows``, captured now if it was not; None where no
        size holds it or the platform declined."""
        size = self.size_for(rows)
        if self.unavailable is not None or size is None:
            return None
        replay = self.captured.get(size) or self._capture(size)
        return None if replay is None else (size, replay)

    def _loaded_rows(self, rows: int) -> None:
        """The step filled the first ``rows``: rows the last step used past them go back to padding."""
        if self._loaded > rows:
            self._pad(rows, self._loaded)
        self._loaded = rows
