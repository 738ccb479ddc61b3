"""One /metrics page for many replicas: each replica's metric families, every sample labelled with its replica.

A replica takes a snapshot of its own registry (plain prometheus_client Metric objects, picklable); merge() lays the
snapshots of all replicas side by side as one family per metric, in the Prometheus text format. No Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

REPLICA_LABEL = "replica"


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    """The registry's families as they are now (gauges backed by functions are read here)."""
    return list(registry.collect())


class _Merged:
    def __init__(self, per_replica: Mapping[str, list[Metric]]) -> None:
        self.per_replica = per_replica

    def collect(self):
        families: dict[str, Metric] = {}
        for replica in sorted(self.per_replica):
            for m in self.per_replica[replica]:
                family = families.get(m.name)
                if family is None:
                    family = families[m.name] = Metric(m.name, m.documentation, m.type, m.unit)
                family.samples.extend(s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in m.samples)
        return list(families.values())


def merge(per_replica: Mapping[str, list[Metric]]) -> bytes:
    """The Prometheus text of all replicas' families, each sample carrying replica="<id>"."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(per_replica))
    return generate_latest(registry)
