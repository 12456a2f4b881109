"""``GET /metrics``: one Prometheus exposition from every observer of every replica.

Observers export through the ``prometheus_collectors`` hook; replicas' families share names
(their samples differ by the ``replica`` label), so each family is written once with all samples.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from prometheus_client import generate_latest


class _Merged:
    """A collector yielding each metric family once, with the samples of every collector."""

    def __init__(self, collectors: Sequence[Any]) -> None:
        self.collectors = collectors

    def collect(self):
        families: dict[str, Any] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    merged = copy.copy(family)
                    merged.samples = list(family.samples)
                    families[family.name] = merged
        return iter(families.values())


def render(collectors: Sequence[Any]) -> bytes:
    return generate_latest(_Merged(collectors))
