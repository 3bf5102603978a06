"""Prometheus metrics of every service (prometheus-client), served over HTTP by `ServiceHost`.

Two kinds:
* histograms observed on the hot path — RPC latency per method (in `rpc.guard`),
  on NN workers the staleness of every lookup, and in the inference service
  each micro-batch's rows and each request's wait in the batcher;
* each service's `stats()` dictionary, read at scrape time by `StatsCollector`
  (no bookkeeping twice): a key ending in `_total` is a counter, anything else a
  gauge, named `hybridrec_<service>_<key>` with a `replica` label.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

RPC_LATENCY = Histogram(
    "hybridrec_rpc_latency_seconds", "Server-side latency of each RPC, by service and method.",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0),
)
REFUSED = Counter(
    "hybridrec_rpc_refused_total", "RPCs refused with PERMISSION_DENIED (caller not authorised, or a path "
    "outside the service's root), by service and method.", ["service", "method"],
)
STALENESS = Histogram(
    "hybridrec_staleness_batches", "Batches with unapplied updates when an NN worker started a lookup.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)

MICRO_BATCH_ROWS = Histogram(
    "hybridrec_inference_micro_batch_rows", "Rows of each micro-batch the inference service's batcher ran.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
)
QUEUE_DELAY = Histogram(
    "hybridrec_inference_queue_delay_seconds", "How long a request waited in the inference batcher before its "
    "micro-batch started (0: answered alone, at once).",
    buckets=(0.0, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1),
)


class StatsCollector(Collector):
    def __init__(self, service: str, replica: int, stats: Callable[[], dict[str, float]]):
        self.service, self.replica, self.stats = service, str(replica), stats

    def collect(self) -> Iterable:
        for key, value in sorted(self.stats().items()):
            name = f"hybridrec_{self.service}_{key}".replace(".", "_")
            if key.endswith("_total"):
                family = CounterMetricFamily(name[:-len("_total")], f"{self.service} {key}", labels=["replica"])
            else:
                family = GaugeMetricFamily(name, f"{self.service} {key}", labels=["replica"])
            family.add_metric([self.replica], float(value))
            yield family


def register_stats(service: str, replica: int, stats: Callable[[], dict[str, float]]) -> None:
    REGISTRY.register(StatsCollector(service, replica, stats))
