"""Prometheus metrics of one node, on a private CollectorRegistry.

Two kinds of metrics:

* request metrics (requests by opcode and status, latency histograms, bytes in/out) are
  plain Python ints and lists bumped on the event loop thread as requests complete (no
  lock, no prometheus_client call per request) and turned into metric families by a
  custom collector at scrape time (``RequestCounters``); connection counts and refused
  HELLOs (rare events) are ordinary prometheus_client Counters/Gauges;
* store metrics (tier occupancy, hits/misses, evictions, guard refusals, WAL backend and
  commit latency) come from ``store.stats()``: the daemon calls ``update_store(stats)``
  about once a second on the loop thread and the scrape (prometheus_client's HTTP thread)
  only reads the last snapshot, so the store is never touched from another thread.

``serve(host, port)`` starts the node's HTTP port on that registry (a daemon thread) and
``close()`` stops it.  Three paths, every other one is a 404:

* ``/metrics``: the registry, as prometheus_client exposes it (text or OpenMetrics, gzip);
* ``/health``: 200 ``ok`` while the process serves this port (liveness);
* ``/ready``: 200 ``ready`` once the node listens (``serve`` is called after its listeners and
  its cluster join), 503 with the reason while ``set_ready(False, why)`` says so or the cluster
  state is ``starting`` or ``stopped`` (readiness: where a load balancer sends engines).
"""
from __future__ import annotations

import socket
import threading
from bisect import bisect_left
from http.server import ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, MetricsHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from quillcache.protocol.opcodes import Opcode, Status
from quillcache.store.values import SSD_COUNTERS, STORE_COUNTERS, TIER_COUNTERS

__all__ = ["NodeMetrics", "RequestCounters", "LATENCY_BUCKETS_S", "HTTP_PATHS"]

HTTP_PATHS = ("/metrics", "/health", "/ready")     # the node's HTTP port answers these, 404 otherwise
NOT_READY_CLUSTER_STATES = ("starting", "stopped")

# seconds: request latency buckets, 20 us .. 5 s
LATENCY_BUCKETS_S = (20e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                     50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0)

_GUARD_REFUSALS = ("tenant", "model", "tokenizer", "adapter")
_OP_NAMES = {int(op): op.name for op in Opcode if op.name != "INFO"}
_STATUS_NAMES = {int(s): s.name for s in Status}
_BUCKET_LABELS = tuple(floatToGoString(b) for b in LATENCY_BUCKETS_S) + ("+Inf",)
_LATENCY_DOC = "Request latency from its last byte in to its reply handed to the transport"


def _num(value) -> Optional[float]:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class _StoreCollector:
    """Yields the store metrics from the last snapshot handed to ``update``."""

    def __init__(self) -> None:
        self._snapshot: dict = {}

    def update(self, stats: dict) -> None:
        self._snapshot = stats            # one reference swap: the scrape thread sees old or new

    def collect(self):
        s = self._snapshot
        used = GaugeMetricFamily("quillcache_tier_used_bytes", "Bytes allocated in the tier", labels=["tier"])
        cap = GaugeMetricFamily("quillcache_tier_capacity_bytes", "Capacity of the tier in bytes",
                                labels=["tier"])
        blocks = GaugeMetricFamily("quillcache_tier_blocks", "Blocks resident in the tier", labels=["tier"])
        # the store's counters, as the store defines them (store/values.py): one list, no copy
        counters = {name: CounterMetricFamily(f"quillcache_tier_{name}", doc, labels=["tier"])
                    for name, doc in (*TIER_COUNTERS.items(), *SSD_COUNTERS.items())}
        for tier in ("dram", "ssd"):
            t = s.get(tier)
            if not t:
                continue
            for fam, field in ((used, "used"), (cap, "capacity"), (blocks, "blocks")):
                v = _num(t.get(field))
                if v is not None:
                    fam.add_metric([tier], v)
            for name in counters:
                v = _num(t.get(name))
                if v is not None:
                    counters[name].add_metric([tier], v)
        yield used
        yield cap
        yield blocks
        yield from counters.values()
        guard = s.get("guard") or {}
        refused = CounterMetricFamily("quillcache_guard_refusals", "Reuse refused by the identity guard",
                                      labels=["violation"])
        for v in _GUARD_REFUSALS:
            n = _num(guard.get(f"reuse_refused_{v}"))
            if n is not None:
                refused.add_metric([v], n)
        yield refused
        store = s.get("store") or {}
        for field, doc in (*STORE_COUNTERS.items(),
                           ("put_wait_seconds", "Seconds puts spent waiting for DRAM room")):
            n = _num(store.get(field))
            if n is not None:
                c = CounterMetricFamily(f"quillcache_store_{field}", doc)
                c.add_metric([], n)
                yield c
        yield from _tenant_families(s.get("tenants") or {})
        wal = s.get("wal") or {}
        commit = GaugeMetricFamily("quillcache_wal_commit_seconds",
                                   "WAL group commit latency (quantiles over the SSD tier's window)",
                                   labels=["quantile"])
        for q, field in (("0.5", "commit_p50_s"), ("0.99", "commit_p99_s")):
            n = _num(wal.get(field))
            if n is not None:
                commit.add_metric([q], n)
        yield commit


def _tenant_families(tenants: dict):
    """Per tenant: its hard-pin quota, the bytes its hard pins hold, its pins refused
    (store/pins.py).  The operator's figures: a tenant never sees another's."""
    quota = GaugeMetricFamily("quillcache_tenant_pin_quota_bytes",
                              "Bytes a tenant's hard pins may hold (-1: no per-tenant quota)", labels=["tenant"])
    held = GaugeMetricFamily("quillcache_tenant_hard_pinned_bytes", "Bytes a tenant's live hard pins hold",
                             labels=["tenant"])
    refused = CounterMetricFamily("quillcache_tenant_pins_refused",
                                  "Hard pins refused by the tenant's quota or the node's hard-pin budget",
                                  labels=["tenant"])
    for tenant, t in sorted(tenants.items()):
        quota.add_metric([tenant], t["pin_quota_bytes"])
        held.add_metric([tenant], t["hard_pinned_bytes"])
        refused.add_metric([tenant], t["pins_refused"])
    yield quota
    yield held
    yield refused


_SENDFILE_DOC = "Of the bytes sent, those sent from the SSD data file by sendfile"


class RequestCounters:
    """Request counts, latency histograms and byte totals kept in plain ints on the loop thread.

    ``observe`` is the only writer (the loop thread); ``collect`` (the scrape thread) copies
    each dict/list in one C-level call under the GIL, so it sees every counter at some value
    it had, never a torn one.  A histogram's count is the sum of its bucket copies, so count
    and buckets always agree (its sum may be one observation ahead or behind).
    """

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}       # (opcode, status) -> requests
        self.buckets: dict[int, list[int]] = {}            # opcode -> per-bucket counts (+Inf last)
        self.sums: dict[int, float] = {}                   # opcode -> seconds observed
        self.received_bytes = 0
        self.sent_bytes = 0
        self.sendfile_bytes = 0                            # of sent_bytes: by sendfile from the SSD file

    def observe(self, opcode: int, status: int, seconds: float) -> None:
        key = (opcode, status)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        b = self.buckets.get(opcode)
        if b is None:
            b = self.buckets[opcode] = [0] * (len(LATENCY_BUCKETS_S) + 1)
        b[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1   # first bucket with le >= seconds
        self.sums[opcode] = self.sums.get(opcode, 0.0) + seconds

    def describe(self):
        yield CounterMetricFamily("quillcache_requests", "Requests answered, by opcode and status",
                                  labels=["opcode", "status"])
        yield HistogramMetricFamily("quillcache_request_seconds", _LATENCY_DOC, labels=["opcode"])
        yield CounterMetricFamily("quillcache_received_bytes", "Bytes received from clients")
        yield CounterMetricFamily("quillcache_sent_bytes", "Bytes handed to client transports")
        yield CounterMetricFamily("quillcache_sendfile_bytes", _SENDFILE_DOC)

    def collect(self):
        counts = self.counts.copy()
        buckets = {op: list(b) for op, b in self.buckets.copy().items()}
        sums = self.sums.copy()
        req = CounterMetricFamily("quillcache_requests", "Requests answered, by opcode and status",
                                  labels=["opcode", "status"])
        for (op, st), n in sorted(counts.items()):
            req.add_metric([_OP_NAMES.get(op, str(op)), _STATUS_NAMES.get(st, str(st))], n)
        yield req
        lat = HistogramMetricFamily("quillcache_request_seconds", _LATENCY_DOC, labels=["opcode"])
        for op, b in sorted(buckets.items()):
            cumulative, acc = [], 0
            for le, n in zip(_BUCKET_LABELS, b):
                acc += n
                cumulative.append((le, acc))
            lat.add_metric([_OP_NAMES.get(op, str(op))], cumulative, sums.get(op, 0.0))
        yield lat
        for name, doc, value in (("quillcache_received_bytes", "Bytes received from clients", self.received_bytes),
                                 ("quillcache_sent_bytes", "Bytes handed to client transports", self.sent_bytes),
                                 ("quillcache_sendfile_bytes", _SENDFILE_DOC, self.sendfile_bytes)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


CLUSTER_STATES = ("starting", "ok", "degraded", "conflict", "stopped")


class NodeMetrics:
    """Every metric of one node on its own registry (never the global one)."""

    def __init__(self, node_id: str = "", version: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Per-request metrics: plain ints bumped on the loop thread, read at scrape time.
        self.requests = RequestCounters()
        r.register(self.requests)
        self.connections = Gauge("quillcache_connections", "Client connections open", registry=r)
        self.connections_total = Counter("quillcache_connections_accepted", "Connections accepted",
                                         registry=r)
        self.connections_refused = Counter("quillcache_connections_refused",
                                           "Connections refused or closed by the node (max_connections, "
                                           "unauthenticated_evicted, hello_timeout, idle_timeout)",
                                           ["reason"], registry=r)
        self.protocol_errors = Counter("quillcache_protocol_errors", "Connections closed on a malformed frame",
                                       registry=r)
        self.failed_hellos = Counter("quillcache_failed_hellos", "HELLOs refused (bad token)", registry=r)
        self.wal_backend = Info("quillcache_wal", "The WAL backend of the SSD tier", registry=r)
        self.build = Info("quillcache_node", "This node", registry=r)
        self.build.info({"node_id": node_id, "version": version})
        self.wal_backend.info({"backend": "none"})
        self.cluster_state = Gauge("quillcache_cluster_state",
                                   "1 for this node's cluster state (ok, degraded, starting, stopped)",
                                   ["state"], registry=r)
        self._store = _StoreCollector()
        r.register(self._store)
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._not_ready = ""
        self._cluster_state = ""

    def observe(self, opcode: int, status: int, seconds: float) -> None:
        """One request answered (called on the loop thread; the server's hot paths call
        ``requests.observe`` directly)."""
        self.requests.observe(opcode, status, seconds)

    def add_received(self, nbytes: int) -> None:
        self.requests.received_bytes += nbytes

    def add_sent(self, nbytes: int) -> None:
        self.requests.sent_bytes += nbytes

    def set_wal_backend(self, backend: str) -> None:
        self.wal_backend.info({"backend": backend})

    def set_cluster_state(self, state: str) -> None:
        self._cluster_state = state
        for s in CLUSTER_STATES:
            self.cluster_state.labels(s).set(1 if s == state else 0)

    def update_store(self, stats: dict) -> None:
        self._store.update(stats)

    def set_ready(self, ready: bool, why: str = "") -> None:
        """What /ready answers (the daemon: False with the reason while it drains)."""
        self._not_ready = "" if ready else (why or "not ready")

    def readiness(self) -> tuple[bool, str]:
        if self._not_ready:
            return False, self._not_ready
        state = self._cluster_state
        if state in NOT_READY_CLUSTER_STATES:
            return False, f"cluster state {state}"
        return True, "ready"

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Start the HTTP port (/metrics, /health, /ready); returns the bound address."""
        metrics = self

        class Handler(MetricsHandler.factory(self.registry)):
            def do_GET(self) -> None:
                path = urlparse(self.path).path
                if path == "/metrics":
                    super().do_GET()
                    return
                if path == "/health":
                    self._plain(200, "ok")
                elif path == "/ready":
                    ready, why = metrics.readiness()
                    self._plain(200 if ready else 503, why)
                else:
                    self._plain(404, f"no such path {path}: this port serves {', '.join(HTTP_PATHS)}")

            def _plain(self, status: int, text: str) -> None:
                body = (text + "\n").encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        server = Server((host, port), Handler)
        thread = threading.Thread(target=server.serve_forever, name="quillcache-metrics", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        return server.server_address[:2]

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
