"""The operator's endpoints, served on ``[gateway] admin_listen`` only, never on the tenants'
address: ``/metrics`` (the refused and cross-identity counts are there, aggregated),
``/quillcache/workers`` (engines, load, hit rates: what ``quillctl gateway`` shows) and
``/quillcache/hot`` (the most routed first blocks: hashes of prompts), and ``/health``."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from quillcache.gateway.http import error, json_errors

if TYPE_CHECKING:
    from quillcache.gateway.app import Gateway

__all__ = ["admin_app", "MAX_HOT"]

MAX_HOT = 1000                      # hot prefixes one /quillcache/hot answer may list


def admin_app(gw: "Gateway") -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8")

    async def workers(request: web.Request) -> web.Response:
        now = time.monotonic()
        out = []
        for e in gw.engines.values():
            healthy = e.healthy(now, gw.cfg.gateway.unhealthy_after)
            out.append({"id": e.id, "url": e.spec.url, "model": e.spec.model, "role": e.spec.role,
                        "source": e.source, "healthy": healthy, "reason": e.unhealthy_reason,
                        "in_flight": e.in_flight, "routed": e.routed, "errors": e.errors,
                        "hit_rate": round(e.hit_blocks / e.prompt_blocks, 4) if e.prompt_blocks else 0.0,
                        "last_event_s": round(now - e.last_event, 3) if e.last_event else None,
                        "events": gw.router.event_stats(e.id), **gw.router.load_of(e.id)})
        doc: dict = {"workers": out}
        if gw.discovery is not None:
            doc["cluster"] = gw.discovery.status()
        return web.json_response(doc)

    async def hot(request: web.Request) -> web.Response:
        try:
            n = int(request.query.get("n", "10"))
        except ValueError:
            return error(400, "n must be an integer", "invalid_request_error")
        if not 1 <= n <= MAX_HOT:
            return error(400, f"n must be in 1..{MAX_HOT}", "invalid_request_error")
        return web.json_response({"hot": gw.router.hot_prefixes(n)})

    app = web.Application(middlewares=[json_errors], client_max_size=1024)
    app.add_routes([web.get("/metrics", metrics), web.get("/quillcache/workers", workers),
                    web.get("/quillcache/hot", hot), web.get("/health", gw.health)])
    return app
