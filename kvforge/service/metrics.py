"""Prometheus metrics and structured (JSON-lines) logs of the router service.

Each :class:`ServiceMetrics` owns its own ``CollectorRegistry`` (several routers may live in one process, as
in the tests). Exposed, all prefixed ``kvforge_router_``:

- ``requests_total{backend, outcome}``: outcome ``ok`` | ``upstream_status`` (backend answered >= 400) |
  ``upstream_failed`` (connection lost mid-response) | ``upstream_timeout`` (504: silence past the read
  timeout) | ``client_gone`` | ``no_backend`` | ``bad_request`` | ``body_timeout`` (408);
- ``retries_total{backend}``: attempts moved off ``backend`` before the response started;
- ``routing_seconds``: histogram of the time to compute keys and place one request (from the end of its body);
- ``backlog_tokens{backend}`` / ``in_flight{backend}`` / ``healthy{backend}`` (read at scrape time);
- ``prompt_tokens_total{backend}`` / ``estimated_hit_tokens_total{backend}``: the router's estimate of the
  prompt tokens the chosen backend had cached (from its KV events when subscribed, else from the blocks the
  router itself sent there);
- ``kv_events_total{backend, kind}``: batches, events, gaps, replayed, lost, bad, duplicates, oversized,
  implausible_seq, resyncs, skipped_blocks, block_size_mismatch (see ``KVEventSubscriber``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

__all__ = ["JsonFormatter", "ServiceMetrics", "configure_logging"]

_LEVELS = ("debug", "info", "warning", "error", "critical")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus the record's ``fields`` extra."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str = "json") -> None:
    if level not in _LEVELS:
        raise ValueError(f"level: expected one of {_LEVELS}, got {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger("kvforge")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class _FleetCollector:
    def __init__(self, snapshot: Callable[[], Iterable[tuple[str, float, int, bool]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        backlog = GaugeMetricFamily("kvforge_router_backlog_tokens", "Token backlog per backend", labels=["backend"])
        flight = GaugeMetricFamily("kvforge_router_in_flight", "Requests in flight per backend", labels=["backend"])
        healthy = GaugeMetricFamily("kvforge_router_healthy", "1 if the backend is in rotation", labels=["backend"])
        for url, load, n, ok in self._snapshot():
            backlog.add_metric([url], load)
            flight.add_metric([url], n)
            healthy.add_metric([url], 1.0 if ok else 0.0)
        return [backlog, flight, healthy]


class ServiceMetrics:
    def __init__(self, snapshot: Callable[[], Iterable[tuple[str, float, int, bool]]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvforge_router_requests", "Requests by backend and outcome", ["backend", "outcome"], registry=r
        )
        self.retries = Counter("kvforge_router_retries", "Attempts moved off a backend", ["backend"], registry=r)
        self.routing_seconds = Histogram(
            "kvforge_router_routing_seconds",
            "Time to key and place one request",
            buckets=(2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
            registry=r,
        )
        self.prompt_tokens = Counter("kvforge_router_prompt_tokens", "Prompt tokens routed", ["backend"], registry=r)
        self.hit_tokens = Counter(
            "kvforge_router_estimated_hit_tokens",
            "Prompt tokens estimated cached on the chosen backend",
            ["backend"],
            registry=r,
        )
        self.kv_events = Counter(
            "kvforge_router_kv_events", "KV-event stream counters", ["backend", "kind"], registry=r
        )
        r.register(_FleetCollector(snapshot))  # type: ignore[arg-type]
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._pending: dict[tuple[Any, tuple[str, ...]], float] = {}

    def add(self, metric: Any, labels: tuple[str, ...], amount: float = 1) -> None:
        """``metric.labels(*labels).inc(amount)``, batched: summed here (one dict update) and handed to the
        counter when the metrics are rendered, not on every request (each ``inc`` there takes a lock and checks
        its argument). For the event loop's thread only; ``amount`` >= 0 (a counter's rule)."""
        key = (metric, labels)
        p = self._pending
        p[key] = p.get(key, 0) + amount

    def flush(self) -> None:
        """Hand what :meth:`add` summed to the counters."""
        p = self._pending
        if p:
            self._pending = {}
            for (metric, labels), amount in p.items():
                self.child(metric, *labels).inc(amount)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: the per-request counters skip prometheus-client's label
        checks and lock after the first request of each backend and outcome (children are never removed)."""
        key = (id(metric), values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*values)
        return c

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)


def now() -> float:
    return time.perf_counter()
