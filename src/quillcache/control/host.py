"""A router hosted by a node: built from ``[router]``, fed by the configured engines' KV
events (one SUB consumer thread each), answering ROUTE and ROUTE_UPDATE requests.

The node's event loop calls ``route`` and ``update``; the consumer threads call the
router's ``apply_events``; the router's lock keeps them apart.

No oracle for another tenant's prompts (docs/security.md):

* a ROUTE answer is computed from the request's identity alone: its overlap, plan, credit and
  logits never count a block cached under another identity.  How many prefix blocks another
  identity holds (``refused``) and what an identity-blind policy credited across identities
  go to the operator's metrics, aggregated, never into the answer;
* a request may name only an identity-scoped policy; ``dynamo`` (identity-blind) is the
  operator's to choose (``[router] module``), and then the figures of the answer are still
  the scoped ones on the engine it chose;
* request ids are the caller's: one the caller names is kept apart from another caller's
  same name, one the router names is 128 random bits, and ROUTE_UPDATE acts only on the
  caller's own requests.  The caller is the connection's authenticated tenant (everyone is
  the same caller on a node without tenants).
"""
from __future__ import annotations

import logging
import secrets
from typing import Any, Optional, Sequence

from quillcache.control.events import EventConsumer
from quillcache.control.modules import EngineSpec, module_policy
from quillcache.control.router import PLAN_DEVICE, PLAN_DISK, PLAN_HOST, PLAN_RECOMPUTE, NoWorkers, Router, \
    RouterConfig
from quillcache.errors import Busy, InvalidArgument, PermissionDenied
from quillcache.model import IdentityScope
from quillcache.protocol import messages
from quillcache.protocol.route import IDENTITY_BLIND, POLICIES

__all__ = ["RouterHost", "build_router_host", "MAX_TRACKED_PER_CALLER"]

log = logging.getLogger("quillcache.control.host")


class RouterHost:
    def __init__(self, module: str, config: RouterConfig, engines: Sequence[EngineSpec] = (),
                 *, start: bool = True) -> None:
        self.module = module
        self.router = Router(config)
        self.engines = tuple(engines)
        self.consumers: dict[str, EventConsumer] = {}
        self._tracked: dict[str, set[str]] = {}     # caller -> its tracked request ids
        for spec in self.engines:
            if not spec.pool:
                self.router.add_worker(spec.id)
            scope = IdentityScope(spec.model, spec.identity_tokenizer, spec.adapter, spec.tenant)
            consumer = EventConsumer(
                spec.kv_events,
                self._on_batch(spec, scope),
                replay_endpoint=spec.kv_replay or None,
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

    def route(self, request, caller: str = "") -> "messages.RouteReply":
        """Decide for a decoded ROUTE request (``protocol.messages.RouteRequest``) of ``caller``
        (the connection's tenant): the answer, computed from the request's identity alone."""
        if request.policy in IDENTITY_BLIND:
            raise PermissionDenied(f"ROUTE: policy {request.policy!r} is identity-blind; a request may name "
                                   f"only an identity-scoped one ({', '.join(self.request_policies)}); "
                                   "the node's own policy is the operator's ([router] module)")
        scope = IdentityScope(request.model, request.tokenizer, request.adapter, request.tenant)
        rid = request.request_id or secrets.token_hex(16)        # 128 bits: nobody guesses another's
        mine = self._tracked.get(caller, set())
        if request.track and rid not in mine and len(mine) >= MAX_TRACKED_PER_CALLER:
            raise Busy(f"ROUTE: {len(mine)} tracked requests open, at most {MAX_TRACKED_PER_CALLER} per "
                       "caller (end them with ROUTE_UPDATE)")
        router = self.router
        hashes = router.hashes(request.items) if request.kind == messages.ROUTE_TOKENS else request.items
        kw: dict[str, Any] = {"request_id": _internal_id(caller, rid), "policy": request.policy,
                              "track": request.track}
        if request.request_tokens:
            kw["request_tokens"] = request.request_tokens
        elif request.kind == messages.ROUTE_TOKENS:
            kw["request_tokens"] = len(request.items)
        try:
            d = router.route(scope, hashes=hashes, **kw)
        except NoWorkers as exc:
            raise Busy(f"ROUTE: {exc}") from None
        except ValueError as exc:
            raise InvalidArgument(f"ROUTE: {exc}") from None
        if request.track:
            self._tracked.setdefault(caller, mine).add(rid)
        if (request.policy or router.config.policy) not in IDENTITY_BLIND:
            dev, host, disk, pool = d.overlap
            return messages.RouteReply(d.worker, rid, router.config.block_size, d.credited_blocks, dev, host,
                                       disk, pool, d.plan, d.logits)
        # The operator's identity-blind policy chose the engine; what the answer says of it is
        # still the request's own: its scoped overlap there, no pool (the policy knows none),
        # and no logits (they priced every identity's blocks).
        m = router.find_matches(scope, hashes)
        w = list(m.workers).index(d.worker)
        dev, host, disk = int(m.device[w]), int(m.host[w]), int(m.disk[w])
        cfg = router.config
        plan = bytes([PLAN_DEVICE] * dev + [PLAN_HOST] * host + [PLAN_DISK] * disk
                     + [PLAN_RECOMPUTE] * (len(hashes) - dev - host - disk))
        credited = cfg.device_weight * dev + cfg.host_weight * host + cfg.disk_weight * disk
        return messages.RouteReply(d.worker, rid, cfg.block_size, credited, dev, host, disk, 0, plan, {})

    @property
    def request_policies(self) -> tuple[str, ...]:
        """The policies a ROUTE request may name (the identity-scoped ones)."""
        return tuple(p for p in POLICIES if p not in IDENTITY_BLIND)

    def update(self, event: int, request_id: str, caller: str = "") -> bool:
        """ROUTE_UPDATE of ``caller``: only its own requests are known to it."""
        mine = self._tracked.get(caller)
        if mine is None or request_id not in mine:
            return False
        internal = _internal_id(caller, request_id)
        if event == messages.ROUTE_FIRST_TOKEN:
            return self.router.first_token(internal)
        mine.discard(request_id)
        if not mine:
            del self._tracked[caller]
        return self.router.free(internal)

    def info(self) -> dict[str, Any]:
        r = self.router
        out: dict[str, Any] = {
            "module": self.module, "policy": r.config.policy, "workers": len(r.workers),
            "decisions": r.stats.decisions,
            "decision_p50_us": round(r.latency_percentile(50), 1),
            "decision_p99_us": round(r.latency_percentile(99), 1),
            "indexed_blocks": len(r.indexer),
        }
        # Refused and cross-identity counts are not here: INFO answers every tenant, and a
        # count that moves after one's own ROUTE tells that another tenant cached the prompt.
        # They are the operator's, in the metrics (quillcache_router_refused_blocks).
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


MAX_TRACKED_PER_CALLER = 65536       # tracked requests one caller may have open at once


def _internal_id(caller: str, request_id: str) -> str:
    """The router's key of a caller's request: two callers' same id never meet."""
    return f"{len(caller)}:{caller}/{request_id}"


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
        approx_ttl_s=section.approx_ttl, kv_blocks=section.kv_blocks or None)
    if policy in IDENTITY_BLIND:
        log.warning("[router] module = %r is identity-blind: which engine a ROUTE names depends on what "
                    "other tenants cached (the answer's figures stay the requester's own)", section.module)
    return RouterHost(section.module, config, section.engines, start=start)
