"""The error a tensor-parallel engine raises once its worker group is gone."""

from __future__ import annotations


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died (or the worker group fell out of step): the engine can
    no longer run. ``Engine.step()`` raises it after finishing every request still in the
    engine with ``finish_reason == "error"`` (their final outputs are in ``outputs``);
    later ``step()`` / ``add_request()`` calls raise it again. ``str(err)`` names the rank."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []
