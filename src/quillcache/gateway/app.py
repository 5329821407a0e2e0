"""quillcache-gateway: an OpenAI-compatible proxy that routes with the control plane.

For each request: authenticate the API key to a tenant, tokenize the prompt, hash its
blocks, ask the router (identity-scoped credit), bump the chosen worker's load, forward,
and stream the engine's answer through chunk by chunk (``gateway.proxy``).  The
``x-quillcache-*`` decision headers go out with the response head, which the engine sends
before its first token, so they cost nothing in TTFT.  docs/gateway.md describes it.

Two applications share one ``Gateway``: the tenants' (``/v1/...`` and ``/health`` on
``[gateway] listen``) and the operator's (``gateway.admin`` on ``[gateway] admin_listen``).
Engines join and leave while it serves (``add_engine``, ``remove_engine``): those of the
config at start, those registered in etcd whenever they come and go (gateway/discovery.py).
SIGHUP swaps in the reloadable settings (``reload``).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Optional

import aiohttp
from aiohttp import web

from quillcache.auth import Authenticator
from quillcache.errors import InvalidArgument, PermissionDenied
from quillcache.gateway.admin import admin_app
from quillcache.gateway.engines import UNHEALTHY_RETRY_S, EngineState
from quillcache.gateway.http import error, json_errors
from quillcache.gateway.kvpages import fetch_kv_tokens
from quillcache.gateway.metrics import GatewayMetrics
from quillcache.gateway.proxy import HEADER_PREFIX, MAX_UPSTREAM_BODY, PREFILL_KV_PARAMS, Proxy
from quillcache.gateway.routing import GatewayRouter
from quillcache.gateway.settings import EngineSpec, engine_conflict
from quillcache.gateway.tokens import TokenizerCache
from quillcache.protocol.route import IDENTITY_BLIND
from quillcache.settings.registry import parse_config

__all__ = ["Gateway", "EngineState", "HEADER_PREFIX", "MAX_UPSTREAM_BODY", "PREFILL_KV_PARAMS"]

log = logging.getLogger("quillcache.gateway")

KV_ASKS = 12                    # times an engine is asked for its KV memory until it answers


class Gateway:
    """The aiohttp applications and everything they share across requests."""

    def __init__(self, cfg, *, router: Optional[GatewayRouter] = None) -> None:
        self.cfg = cfg
        g = cfg.gateway
        self.auth = Authenticator(cfg.auth.tenants, cfg.auth.max_failed_hellos)
        self.metrics = GatewayMetrics()
        self.router = router if router is not None else GatewayRouter(cfg)
        self.engines: dict[str, EngineState] = {}
        self.by_model: dict[str, list[EngineState]] = {}
        self.adapters: dict[str, str] = {}               # adapter name -> base model
        self._tokenizers = TokenizerCache()
        self._started = False
        for spec in g.engines:
            self.add_engine(spec)
        self.discovery = None
        if cfg.cluster.enabled:
            from quillcache.gateway.discovery import EngineDiscovery
            self.discovery = EngineDiscovery(self)
        self._session: Optional[aiohttp.ClientSession] = None
        self._tasks: list[asyncio.Task] = []
        self._kv_asks: set[asyncio.Task] = set()
        self.proxy = Proxy(self)
        self.app = web.Application(client_max_size=g.max_body, middlewares=[json_errors])
        self.app.add_routes([
            web.post("/v1/completions", self.proxy.completions),
            web.post("/v1/chat/completions", self.proxy.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ])
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)
        self.admin_app = admin_app(self)
        self._warn_identity_blind()

    def _warn_identity_blind(self) -> None:
        if self.cfg.router.policy in IDENTITY_BLIND and not self.auth.open_mode:
            log.warning("[router] policy = %r is identity-blind: which engine serves a tenant depends on "
                        "what other tenants cached (a baseline to compare with, not one to serve tenants)",
                        self.cfg.router.policy)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP client session to the engines (from startup to cleanup)."""
        if self._session is None:
            raise RuntimeError("the gateway is not started")
        return self._session

    # ------------------------------------------------------------------ engines

    def add_engine(self, spec: EngineSpec, source: str = "config") -> EngineState:
        """Serve ``spec`` from now on.  Raises InvalidArgument (saying why) when it cannot serve
        beside the engines already here, or when its tokenizer files do not load."""
        if spec.id in self.engines:
            raise InvalidArgument(f"engine {spec.id!r} is already served (from the {self.engines[spec.id].source})")
        why = engine_conflict(spec, [e.spec for e in self.engines.values()])
        if why is not None:
            raise InvalidArgument(why)
        tokenizer = self._tokenizers.get(spec)
        try:
            self.router.add_engine(spec)
        except ValueError as exc:
            raise InvalidArgument(f"the router of model {spec.model!r} cannot take it: {exc}") from None
        state = EngineState(spec, tokenizer=tokenizer, source=source)
        self.engines[spec.id] = state
        self.by_model.setdefault(spec.model, []).append(state)
        for name in spec.adapters:
            self.adapters[name] = spec.model
        if self._started and spec.kv_events:
            self.router.start_events(spec, on_batch=state.on_events)
        if self._started:
            self._ask_kv(state)
        self.metrics.healthy.labels(spec.id).set(1)
        return state

    def _ask_kv(self, state: EngineState) -> None:
        if self.router.learn_kv_blocks and state.spec.url:
            task = asyncio.get_running_loop().create_task(self._learn_kv(state))
            self._kv_asks.add(task)
            task.add_done_callback(self._kv_asks.discard)

    async def _learn_kv(self, state: EngineState) -> None:
        """Ask the engine how much KV it holds ([router] learn_kv_blocks), until it answers
        (KV_ASKS times at most, UNHEALTHY_RETRY_S apart: an engine may start after the gateway)."""
        for attempt in range(KV_ASKS):
            if attempt:
                await asyncio.sleep(UNHEALTHY_RETRY_S)
            if self.engines.get(state.id) is not state:
                return                                  # removed meanwhile
            try:
                tokens = await fetch_kv_tokens(self.session, state.spec.url, UNHEALTHY_RETRY_S)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
            except Exception:                           # an answer no parser expected: say so, once
                log.warning("engine %s: its answer on its KV memory could not be read", state.id, exc_info=True)
                return
            if tokens is None:
                log.info("engine %s says nothing of its KV memory (no vllm:cache_config_info on /metrics, "
                         "no max_total_num_tokens in /server_info): set [router] kv_blocks", state.id)
                return
            if self.engines.get(state.id) is state:
                blocks = self.router.learn_kv(state.id, tokens)
                log.info("engine %s holds %d tokens of KV: model %s routes with kv_blocks = %s",
                         state.id, tokens, state.spec.model, blocks)
            return

    async def remove_engine(self, engine_id: str) -> None:
        """Stop routing to the engine at once; answers in flight on it run to their end."""
        state = self.engines.pop(engine_id, None)
        if state is None:
            return
        peers = [e for e in self.by_model[state.spec.model] if e is not state]
        if peers:
            self.by_model[state.spec.model] = peers
        else:
            del self.by_model[state.spec.model]
        self.adapters = {a: e.spec.model for e in self.engines.values() for a in e.spec.adapters}
        for gauge in (self.metrics.healthy, self.metrics.in_flight):
            try:
                gauge.remove(engine_id)
            except KeyError:
                pass
        consumer = self.router.detach_events(engine_id)
        if consumer is not None:              # closed first: a late batch would re-add the worker
            await asyncio.get_running_loop().run_in_executor(None, consumer.close)
        self.router.remove_engine(engine_id)

    # ------------------------------------------------------------------ lifecycle

    async def _startup(self, app) -> None:
        g = self.cfg.gateway
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, family=socket.AF_INET)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None,
                                                                            connect=g.connect_timeout))
        self._started = True
        for state in self.engines.values():
            if state.spec.kv_events:
                self.router.start_events(state.spec, on_batch=state.on_events)
            self._ask_kv(state)
        self._tasks.append(asyncio.create_task(self.router.run_sweeper()))
        if self.discovery is not None:
            await self.discovery.start()

    async def _cleanup(self, app) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        asks = list(self._kv_asks)
        for task in self._tasks + asks:
            task.cancel()
        await asyncio.gather(*self._tasks, *asks, return_exceptions=True)
        self._tasks.clear()
        await self.router.close()
        if self._session is not None:
            await self._session.close()

    def reload(self, new) -> tuple[list[str], list[str]]:
        """Take the reloadable settings of ``new`` (a validated config); returns (applied,
        kept: changed settings that need a restart).  Requests read the config at each use,
        so the next one sees the new values; those in flight keep theirs."""
        apply, fixed = self.cfg.reloadable_changes(new)
        if apply:
            # The new file's values, less the changes that need a restart (those stay as running).
            raw = {section: dict(table) for section, table in new.raw.items()}
            for qualname in fixed:
                section, name = qualname.split(".", 1)
                running = self.cfg.raw.get(section, {})
                if name in running:
                    raw.setdefault(section, {})[name] = running[name]
                else:
                    raw.get(section, {}).pop(name, None)
            self.cfg = parse_config(raw, new.source, self.cfg.registry)
            if "auth.tenants" in apply or "auth.max_failed_hellos" in apply:
                self.auth.configure(self.cfg.auth.tenants, self.cfg.auth.max_failed_hellos)
            self.router.reconfigure(self.cfg)
            self._warn_identity_blind()
        return sorted(apply), sorted(fixed)

    # ------------------------------------------------------------------ tenants' endpoints

    async def models(self, request: web.Request) -> web.Response:
        """The served models and adapters, to a client with a key (adapter names may be a
        tenant's own: they are not for anyone who asks)."""
        try:
            self.proxy.tenant_of(request)
        except PermissionDenied as exc:
            return error(401, str(exc), "authentication_error")
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "quillcache"}
                for m in sorted(self.by_model)]
        data += [{"id": a, "object": "model", "created": now, "owned_by": "quillcache", "parent": base}
                 for a, base in sorted(self.adapters.items())]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        healthy = [e.id for e in self.engines.values() if e.healthy(now, self.cfg.gateway.unhealthy_after)]
        status = 200 if healthy else 503
        return web.json_response({"status": "ok" if healthy else "no healthy engine",
                                  "healthy": healthy, "engines": len(self.engines)}, status=status)
