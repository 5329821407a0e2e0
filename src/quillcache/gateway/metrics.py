"""The gateway's Prometheus metrics, on a private registry served at ``/metrics`` on the admin
address only: the refused and cross-identity counts are the operator's, never a tenant's."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics", "TTFT_BUCKETS_S", "ITL_BUCKETS_S", "TIERS"]

# seconds: time to first token, 5 ms .. 30 s
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 30.0)
# seconds: inter-token latency, 1 ms .. 2 s
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 2.0)
TIERS = ("device", "host", "disk", "pool")


class GatewayMetrics:
    """Every metric the gateway exports; handlers call the small ``on_*`` methods."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("quillcache_gateway_ttft_seconds", "Time to first token of streamed "
                              "answers, from the request's arrival", buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("quillcache_gateway_inter_token_seconds", "Time between streamed chunks "
                             "of an answer", buckets=ITL_BUCKETS_S, registry=r)
        self.decisions = Counter("quillcache_gateway_decisions", "Requests routed, by worker",
                                 ["worker"], registry=r)
        self.decision_seconds = Histogram("quillcache_gateway_decision_seconds", "Routing decision "
                                          "latency (tokenize, hash, score)",
                                          buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3,
                                                   5e-3, 10e-3, 50e-3), registry=r)
        self.prompt_blocks = Counter("quillcache_gateway_prompt_blocks", "Blocks of routed prompts",
                                     registry=r)
        self.hit_blocks = Counter("quillcache_gateway_hit_blocks", "Prompt blocks credited as cached "
                                  "on the chosen worker, by tier (hit rate = this / prompt_blocks)",
                                  ["tier"], registry=r)
        self.reuse_refused = Counter("quillcache_gateway_reuse_refused_blocks", "Cached prefix blocks "
                                     "refused credit because another identity cached them", registry=r)
        self.cross_credited = Counter("quillcache_gateway_cross_identity_credited_blocks", "Blocks "
                                      "credited to the chosen worker though another identity cached "
                                      "them (only the identity-blind dynamo policy does)", registry=r)
        self.requests = Counter("quillcache_gateway_requests", "Answered requests by endpoint and "
                                "HTTP status", ["endpoint", "status"], registry=r)
        self.slo = Counter("quillcache_gateway_slo_requests", "Streamed requests that finished, by "
                           "whether they met the TTFT and TPOT objectives (goodput = met / all)",
                           ["met"], registry=r)
        self.upstream_errors = Counter("quillcache_gateway_upstream_errors", "Failed upstream "
                                       "requests, by worker and stage", ["worker", "stage"], registry=r)
        self.retries = Counter("quillcache_gateway_retries", "Requests retried on another worker "
                               "after a failure before the first byte", registry=r)
        self.rejected = Counter("quillcache_gateway_rejected", "Requests refused with 429 because "
                                "every worker was at its queue limit", registry=r)
        self.admission_refused = Counter("quillcache_gateway_admission_refused", "Requests refused with "
                                         "429 by [router] admission = \"predict\": their predicted TTFT "
                                         "was past admission_k x slo_ttft (sent to no engine)", registry=r)
        self.disconnects = Counter("quillcache_gateway_client_disconnects", "Clients that left "
                                   "before the end of their answer", registry=r)
        self.in_flight = Gauge("quillcache_gateway_in_flight", "Requests in flight, by worker",
                               ["worker"], registry=r)
        self.healthy = Gauge("quillcache_gateway_worker_healthy", "1 when the worker is routed to",
                             ["worker"], registry=r)
        self.etcd_engines = Gauge("quillcache_gateway_etcd_engines", "Engines served from etcd "
                                  "([cluster] enabled)", registry=r)
        self.etcd_rejected = Gauge("quillcache_gateway_etcd_rejected_records", "Engine records in etcd "
                                   "that are not served (GET /quillcache/workers says why)", registry=r)
        self.etcd_state = Gauge("quillcache_gateway_etcd_state", "1 for the state of the etcd engine "
                                "view: starting, ok, degraded (etcd unreachable: the last view is kept)",
                                ["state"], registry=r)
        self.connections_refused = Counter("quillcache_gateway_connections_refused", "Client connections "
                                           "answered 503 and closed at once, by the limit they were past "
                                           "(max_connections, max_connections_per_peer)", ["reason"],
                                           registry=r)
        self.client_timeouts = Counter("quillcache_gateway_client_timeouts", "Clients cut off: a body "
                                       "not in within client_body_timeout (408), an answer not taken "
                                       "within client_send_timeout", ["stage"], registry=r)
        self.stripped_fields = Counter("quillcache_gateway_stripped_fields", "Engine-internal body "
                                       "fields a client sent and the gateway removed", ["field"], registry=r)
        for tier in TIERS:
            self.hit_blocks.labels(tier)
        for met in ("true", "false"):
            self.slo.labels(met)

    def on_decision(self, worker: str, seconds: float, blocks: int, overlap: dict, refused: int,
                    cross_credited: int = 0) -> None:
        self.decisions.labels(worker).inc()
        self.decision_seconds.observe(seconds)
        self.prompt_blocks.inc(blocks)
        for tier in TIERS:
            n = overlap.get(tier, 0)
            if n:
                self.hit_blocks.labels(tier).inc(n)
        if refused:
            self.reuse_refused.inc(refused)
        if cross_credited:
            self.cross_credited.inc(cross_credited)

    def on_stream_done(self, ttft_s: float, tpot_s: "float | None", slo_ttft: float, slo_tpot: float) -> bool:
        met = ttft_s <= slo_ttft and (tpot_s is None or tpot_s <= slo_tpot)
        self.slo.labels("true" if met else "false").inc()
        return met

    def on_etcd_state(self, state: str) -> None:
        for name in ("starting", "ok", "degraded"):
            self.etcd_state.labels(name).set(1 if name == state else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
