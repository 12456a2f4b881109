"""Plugin fault isolation: a plugin that raises fails only the requests it was handling.

The engine catches an exception at each plugin boundary of the step (retrying batched
calls request by request, so only the requests that make the plugin raise fail), names the plugin
from the traceback (the innermost frame running a method of a chosen plugin object), and fails
the touched requests with ``finish_reason="error"`` and a message naming the plugin.
Their blocks return to the pool; the engine keeps serving everyone else.
"""

from __future__ import annotations

import logging
import traceback

log = logging.getLogger("modserve.engine")


class PluginFault:
    """Maps code locations to the pipeline's chosen plugins, to name the one that raised."""

    def __init__(self, plugins: dict[str, tuple[str, object]]) -> None:
        """``plugins``: ``{section: (plugin name, implementation object)}``."""
        self._labels = {id(obj): f"{section} plugin {name!r}" for section, (name, obj) in plugins.items()}

    def describe(self, exc: BaseException, default: str) -> str:
        """``"<section> plugin '<name>' failed: <ExceptionType>: <message>"``."""
        culprit = default
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in self._labels:
                culprit = self._labels[id(owner)]  # keep walking: the innermost plugin frame wins
        message = f"{culprit} failed: {type(exc).__name__}: {exc}"
        log.error("%s", message, exc_info=exc)
        return message


def run_isolated(fn, items: list) -> tuple[list, list[tuple[object, Exception]]]:
    """``fn(items)`` returns one result per item. If it raises, retry item by item so that
    only the items that raise on their own fail: returns (results with None for failed
    items, [(item, exception)])."""
    try:
        return list(fn(items)), []
    except Exception as e:
        if len(items) == 1:
            return [None], [(items[0], e)]
    results, faults = [], []
    for item in items:
        try:
            results.append(fn([item])[0])
        except Exception as e:
            results.append(None)
            faults.append((item, e))
    return results, faults
