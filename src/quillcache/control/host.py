"""A router hosted by a node: built from ``[router]``, fed by the configured engines' KV
events (one SUB consumer thread each), answering ROUTE and ROUTE_UPDATE requests.

The node's event loop calls ``route`` and ``update``; the consumer threads call the
router's ``apply_events``; the router's lock keeps them apart.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from quillcache.control.events import EventConsumer
from quillcache.control.modules import EngineSpec, module_policy
from quillcache.control.router import Decision, NoWorkers, Router, RouterConfig
from quillcache.errors import Busy, InvalidArgument
from quillcache.model import IdentityScope

__all__ = ["RouterHost", "build_router_host"]

log = logging.getLogger("quillcache.control.host")


class RouterHost:
    def __init__(self, module: str, config: RouterConfig, engines: Sequence[EngineSpec] = (),
                 *, start: bool = True) -> None:
        self.module = module
        self.router = Router(config)
        self.engines = tuple(engines)
        self.consumers: dict[str, EventConsumer] = {}
        for spec in self.engines:
            if not spec.pool:
                self.router.add_worker(spec.id)
            scope = IdentityScope(spec.model, spec.tokenizer, spec.adapter, spec.tenant)
            consumer = EventConsumer(
                spec.endpoint,
                self._on_batch(spec, scope),
                replay_endpoint=spec.replay_endpoint,
                topic=spec.topic.encode("utf-8"),
                on_reset=self._on_reset(spec),
            )
            self.consumers[spec.id] = consumer
            if start:
                consumer.start()

    def _on_batch(self, spec: EngineSpec, scope: IdentityScope):
        router, pool = self.router, spec.pool

        def on_batch(seq: int, batch) -> None:
            router.apply_events(spec.id, batch, scope, pool=pool)
        return on_batch

    def _on_reset(self, spec: EngineSpec):
        def on_reset() -> None:
            log.warning("KV events of %s: publisher restarted or batches lost; its blocks are forgotten",
                        spec.id)
            self.router.clear_source(spec.id)
        return on_reset

    def route(self, request) -> Decision:
        """Decide for a decoded ROUTE request (``protocol.messages.RouteRequest``)."""
        from quillcache.protocol.messages import ROUTE_TOKENS
        scope = IdentityScope(request.model, request.tokenizer, request.adapter, request.tenant)
        kw: dict[str, Any] = {"request_id": request.request_id, "policy": request.policy,
                              "track": request.track}
        if request.request_tokens:
            kw["request_tokens"] = request.request_tokens
        try:
            if request.kind == ROUTE_TOKENS:
                return self.router.route(scope, request.items, **kw)
            return self.router.route(scope, hashes=request.items, **kw)
        except NoWorkers as exc:
            raise Busy(f"ROUTE: {exc}") from None
        except ValueError as exc:
            raise InvalidArgument(f"ROUTE: {exc}") from None

    def update(self, event: int, request_id: str) -> bool:
        from quillcache.protocol.messages import ROUTE_FIRST_TOKEN
        if event == ROUTE_FIRST_TOKEN:
            return self.router.first_token(request_id)
        return self.router.free(request_id)

    def info(self) -> dict[str, Any]:
        r = self.router
        out: dict[str, Any] = {
            "module": self.module, "policy": r.config.policy, "workers": len(r.workers),
            "decisions": r.stats.decisions,
            "decision_p50_us": round(r.latency_percentile(50), 1),
            "decision_p99_us": round(r.latency_percentile(99), 1),
            "indexed_blocks": len(r.indexer),
            "refused_blocks": r.stats.refused_blocks,
        }
        for name, c in self.consumers.items():
            st = c.stats
            out[f"events_{name}"] = (f"batches={st.batches},gaps={st.gaps},replayed={st.replayed},"
                                     f"lost={st.lost},decode_errors={st.decode_errors}")
        return out

    def export_metrics(self, registry) -> None:
        self.router.export_metrics(registry)

    def close(self) -> None:
        for c in self.consumers.values():
            c.close()
        self.consumers.clear()


def build_router_host(section, *, start: bool = True) -> Optional[RouterHost]:
    """The router host a node's ``[router]`` section asks for, or None for ``module = "none"``.
    ``section`` is the converted section (``cfg.router``)."""
    policy = module_policy(section.module)
    if policy is None:
        return None
    config = RouterConfig(
        policy=policy, block_size=section.block_size, prefill_load_scale=section.prefill_load_scale,
        active_request_weight=section.active_request_weight, host_weight=section.host_weight,
        disk_weight=section.disk_weight, pool_weight=section.pool_weight,
        temperature=section.temperature, approximate=section.approximate,
        approx_ttl_s=section.approx_ttl)
    return RouterHost(section.module, config, section.engines, start=start)
