"""The gateway's request path: authenticate, parse, tokenize and hash a request, route it,
forward it, and stream the engine's answer through (docs/gateway.md).

* a failure before the first byte (connect, engine 5xx, first-byte timeout) is retried
  once on another worker; after the first byte an error ends the stream with an error
  event and ``data: [DONE]``;
* when every worker of the model is at ``queue_limit``: 429 with Retry-After;
* with ``[router] admission = "predict"``, a request predicted to miss ``admission_k`` x
  ``[gateway] slo_ttft`` on the engine chosen: 429 with Retry-After (the excess), sent to no engine;
* a client that disconnects cancels the upstream request (the handler is cancelled and
  the upstream connection closed) and frees the router's state;
* a body that has not arrived within ``client_body_timeout`` is answered 408;
* the tenant comes from the API key only; with tenants configured the forwarded body's
  ``cache_salt`` is set from the tenant, so the engine isolates its cache the same way;
  the engine-internal fields a client sends (``kv_transfer_params`` ...) are removed;
* the ``x-quillcache-*`` headers are computed from the request's own identity alone: no
  count of blocks another identity cached, no timing of the decision (docs/security.md);
* a model served by "prefill" and "decode" engines is served in two hops, as vLLM's
  disaggregated-serving proxy does: the prompt goes to a prefill engine (cache-aware) with
  ``max_tokens`` 1 and ``kv_transfer_params.do_remote_decode``, then the request with the
  ``kv_transfer_params`` it returned goes to a decode engine (least loaded), streamed through.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import aiohttp
from aiohttp import web

from quillcache.auth import OPEN_TENANT
from quillcache.connectors.core import TENANT_SALT_PREFIX
from quillcache.errors import InvalidArgument, PermissionDenied
from quillcache.gateway.engines import UNHEALTHY_RETRY_S, EngineState
from quillcache.gateway.http import error, read_at_most, sse_error, strip_internal
from quillcache.gateway.metrics import TIERS
from quillcache.gateway.routing import Decision, Identity

if TYPE_CHECKING:
    from quillcache.gateway.app import Gateway

__all__ = ["Proxy", "HEADER_PREFIX", "MAX_UPSTREAM_BODY", "PREFILL_KV_PARAMS"]

log = logging.getLogger("quillcache.gateway")

HEADER_PREFIX = "x-quillcache-"
MAX_UPSTREAM_BODY = 64 << 20        # bytes: largest non-streamed answer passed through
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                "server", "date"}
# What vLLM's disaggregated-serving proxy asks of a prefill engine (NixlConnector and the
# connectors that follow its protocol): compute the prompt, keep its KV for a remote decode.
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _role_only(chunk: bytes) -> bool:
    """A chat stream's first chunk that only announces the role (no token yet)."""
    return b'"role"' in chunk and b'"content":""' in chunk.replace(b'": "', b'":"') \
        and chunk.count(b"data:") == 1


class _BodyTimeout(Exception):
    """The request body did not arrive within [gateway] client_body_timeout."""


class _Upstream(Exception):
    """A failure before the first byte of the answer: the request may go to another worker."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass
class _Request:
    """One client request, parsed, tokenized and hashed: what every hop needs."""

    identity: Identity
    engines: list
    n_tokens: int
    hashes: list
    forward: dict                        # the body to send upstream
    path: str
    stream: bool
    approximate: bool
    t_arrival: float
    request_id: str                      # X-Request-Id of both hops of a disaggregated request


def _max_tokens(body: dict) -> int:
    """The tokens the client lets the engine generate (0: not said, or not a count)."""
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    return n if type(n) is int and n > 0 else 0


class Proxy:
    """The completions endpoints over the gateway's engines, router and metrics."""

    def __init__(self, gateway: "Gateway") -> None:
        self.gw = gateway

    # The gateway's state, read at each use: engines come and go, SIGHUP swaps the config.
    @property
    def cfg(self):
        return self.gw.cfg

    @property
    def auth(self):
        return self.gw.auth

    @property
    def metrics(self):
        return self.gw.metrics

    @property
    def router(self):
        return self.gw.router

    @property
    def engines(self) -> dict:
        return self.gw.engines

    @property
    def by_model(self) -> dict:
        return self.gw.by_model

    @property
    def adapters(self) -> dict:
        return self.gw.adapters

    # ------------------------------------------------------------------ parsing

    def tenant_of(self, request: web.Request) -> str:
        """The request's tenant, from its API key alone; raises PermissionDenied."""
        header = request.headers.get("Authorization", "")
        if self.auth.open_mode:
            return OPEN_TENANT
        if not header.startswith("Bearer ") or len(header) > 4096:
            raise PermissionDenied("missing API key (Authorization: Bearer <key>)")
        return self.auth.authenticate(header[7:].strip().encode())

    async def _body(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > self.cfg.gateway.max_body:
            raise web.HTTPRequestEntityTooLarge(max_size=self.cfg.gateway.max_body,
                                                actual_size=request.content_length)
        try:
            # A deadline for the whole body: a client trickling it byte by byte holds a
            # connection for client_body_timeout at most (aiohttp has no such timeout).
            async with asyncio.timeout(self.cfg.gateway.client_body_timeout):
                raw = await request.read()       # bounded by client_max_size (413 past it)
        except TimeoutError:
            raise _BodyTimeout() from None
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object")
        return body

    def _identity(self, body: dict, tenant: str) -> tuple[Identity, list[EngineState]]:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise InvalidArgument("model must be a non-empty string")
        base, adapter = name, None
        if name in self.adapters:                              # vLLM: the adapter's own name
            base, adapter = self.adapters[name], name
        elif name not in self.by_model and ":" in name:        # SGLang: "base:adapter"
            b, a = name.rsplit(":", 1)
            if self.adapters.get(a) == b:
                base, adapter = b, a
        engines = self.by_model.get(base)
        if engines is None:
            raise LookupError(f"the model {name!r} is not served here (GET /v1/models lists them)")
        lora = body.get("lora_path")                           # SGLang's adapter field
        if lora is not None:
            if not isinstance(lora, str) or not lora:
                raise InvalidArgument("lora_path must be the name of a served adapter")
            if adapter is not None and lora != adapter:
                raise InvalidArgument(f"model names the adapter {adapter!r} and lora_path {lora!r}")
            if self.adapters.get(lora) != base:
                raise LookupError(f"the adapter {lora!r} is not served for the model {base!r}")
            adapter = lora
        if adapter is not None:
            engines = [e for e in engines if adapter in e.spec.adapters]
        if self.auth.open_mode and isinstance(body.get("cache_salt"), str) and body["cache_salt"]:
            # No API keys: the engine isolates by the client's salt, so credit must too.
            tenant = "salt:" + body["cache_salt"]
        spec = engines[0].spec
        return Identity(base, spec.identity_tokenizer, adapter, tenant), engines

    def _forward_body(self, body: dict, tenant: str) -> dict:
        body, stripped = strip_internal(body)
        for name in stripped:        # only the gateway sets these (its prefill/decode hops)
            self.metrics.stripped_fields.labels(name).inc()
        if not self.auth.open_mode:
            body = dict(body)
            # Never the client's own salt; the connectors read the tenant back from it.
            body["cache_salt"] = TENANT_SALT_PREFIX + tenant
        return body

    def _decision_headers(self, d: Decision, worker: str, approximate: bool, retried: bool,
                          prefill: Optional[tuple[Decision, str, bool]] = None) -> dict:
        """The x-quillcache-* headers; for a two-hop request the cache figures are the prefill
        hop's (where the prefix is computed) and ``worker`` is the decode engine.  Every figure
        is the request's own identity's: no count of blocks another identity holds (that is
        the operator's metric), and no decision time (it depends on what others cached)."""
        if prefill is not None:
            retried = retried or prefill[2]
            d = prefill[0]
        o = d.overlap
        h = {
            HEADER_PREFIX + "worker": worker,
            HEADER_PREFIX + "overlap-blocks": ", ".join(f"{t}={o.get(t, 0)}" for t in TIERS),
            HEADER_PREFIX + "local-hits": str(d.local_hits),
            HEADER_PREFIX + "plan": f"hit={d.plan_hit}, fetch={d.plan_fetch}, recompute={d.plan_recompute}",
            HEADER_PREFIX + "prompt-blocks": str(d.blocks),
            HEADER_PREFIX + "tokenizer": "approximate" if approximate else "exact",
        }
        if prefill is not None:
            h[HEADER_PREFIX + "prefill-worker"] = prefill[1]
        if retried:
            h[HEADER_PREFIX + "retried"] = "1"
        return h

    def _candidates(self, engines: list[EngineState], exclude: set) -> tuple[list[EngineState], bool]:
        """Healthy engines still served and under their queue limit; the flag says whether any
        healthy one exists."""
        now = time.monotonic()
        g = self.cfg.gateway
        healthy = []
        for e in engines:
            if self.engines.get(e.id) is not e:
                continue                                   # it left while this request ran
            ok = e.healthy(now, g.unhealthy_after) and e.id not in exclude
            self.metrics.healthy.labels(e.id).set(1 if ok else 0)
            if ok:
                healthy.append(e)
        return [e for e in healthy if e.in_flight < g.queue_limit], bool(healthy)

    def _pick(self, req: _Request, engines: list[EngineState], tried: set, policy: Optional[str] = None,
              counts: bool = True, prefill_hop: bool = False):
        """Route among ``engines``: (decision, engine) with the engine's load bumped, or the
        error answer when none can take the request."""
        candidates, any_healthy = self._candidates(engines, tried)
        if not candidates:
            if tried:
                return error(502, "the engine failed before answering and no other engine is "
                                   "available", "upstream_error")
            if not any_healthy:
                return error(503, "no healthy engine serves this model", "unavailable")
            self.metrics.rejected.inc()
            retry = max(1, math.ceil(self.cfg.gateway.retry_after))
            return error(429, "every engine of this model is at its queue limit",
                          "rate_limit_error", headers={"Retry-After": str(retry)})
        d = self.router.decide(req.identity, req.hashes, req.n_tokens, [c.id for c in candidates], policy,
                               1 if prefill_hop else _max_tokens(req.forward))
        if not d.admitted:
            return self._refused(d)
        state = self.engines[d.worker]
        state.in_flight += 1
        state.routed += 1
        if counts:
            state.prompt_blocks += d.blocks
            state.hit_blocks += d.local_hits
            self.metrics.on_decision(state.id, d.decision_us / 1e6, d.blocks, d.overlap, d.refused,
                                     d.cross_credited)
        else:
            self.metrics.decisions.labels(state.id).inc()
        if state.spec.kv_events and not state.pending_since:
            state.pending_since = time.monotonic()
        self.metrics.in_flight.labels(state.id).set(state.in_flight)
        return d, state

    def _refused(self, d: Decision) -> web.Response:
        """A request that [router] admission = "predict" refused: predicted to miss
        admission_k x [gateway] slo_ttft even on the best engine.  429, no engine sees it;
        Retry-After is how far the prediction is past the objective (at least 1 s)."""
        self.metrics.admission_refused.inc()
        slo = self.cfg.gateway.slo_ttft
        retry = max(1, math.ceil(d.predicted_ttft_us / 1e6 - slo))
        # Only the whole seconds of Retry-After tell the client anything of the prediction: it
        # is a function of every tenant's load and of this identity's own cached blocks.
        return error(429, "the engines are too busy for this request now: its predicted time to first "
                          "token is past [router] admission_k x [gateway] slo_ttft", "rate_limit_error",
                     headers={"Retry-After": str(retry)})

    def _release(self, d: Decision, state: EngineState) -> None:
        state.in_flight -= 1
        if self.engines.get(state.id) is state:
            self.metrics.in_flight.labels(state.id).set(state.in_flight)
        self.router.finish(d.request_id)

    def _failed(self, state: EngineState, exc: _Upstream, attempt: int) -> None:
        state.errors += 1
        self.metrics.upstream_errors.labels(state.id, exc.stage).inc()
        log.warning("engine %s failed before answering (%s): %s", state.id, exc.stage, exc)
        if attempt == 0:
            self.metrics.retries.inc()


    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False, endpoint="completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True, endpoint="chat")

    async def _serve(self, request: web.Request, chat: bool, endpoint: str) -> web.StreamResponse:
        status = 500
        try:
            resp = await self._proxy(request, chat)
            status = resp.status
            return resp
        except PermissionDenied as exc:
            status = 401
            return error(401, str(exc), "authentication_error")
        except InvalidArgument as exc:
            status = 400
            return error(400, str(exc), "invalid_request_error")
        except LookupError as exc:
            status = 404
            return error(404, str(exc), "model_not_found")
        except _BodyTimeout:
            status = 408
            self.metrics.client_timeouts.labels("body").inc()
            resp = error(408, f"the body did not arrive within [gateway] client_body_timeout = "
                              f"{self.cfg.gateway.client_body_timeout:g}s", "timeout_error")
            resp.force_close()                   # what is left of the body is not read
            return resp
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error(413, f"the body is larger than [gateway] max_body = {self.cfg.gateway.max_body} "
                               "bytes", "invalid_request_error")
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    async def _proxy(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t_arrival = time.monotonic()
        tenant = self.tenant_of(request)
        body = await self._body(request)
        identity, engines = self._identity(body, tenant)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidArgument("stream must be a boolean")
        tok = engines[0].tokenizer
        prompt = tok.prompt_of(body, chat)
        tokens = await tok.encode(prompt)
        if len(tokens) > self.cfg.gateway.max_prompt_tokens:
            raise InvalidArgument(f"the prompt has {len(tokens)} tokens: at most "
                                  f"[gateway] max_prompt_tokens = {self.cfg.gateway.max_prompt_tokens}")
        hashes = self.router.block_hashes(tokens, engines[0].spec.block_size)
        forward = self._forward_body(body, tenant)
        if not chat and not tok.approximate:
            forward = {**forward, "prompt": tokens}    # the engine prefills exactly what was hashed
        # Token ids given by the client are exact whatever the tokenizer: nothing was guessed.
        req = _Request(identity, engines, len(tokens), hashes, forward,
                       "/v1/chat/completions" if chat else "/v1/completions", stream,
                       tok.approximate and isinstance(prompt, str), t_arrival, uuid.uuid4().hex)
        if engines[0].spec.role != "both":
            return await self._disaggregated(request, req)
        return await self._route(request, req, engines, forward)

    async def _route(self, request: web.Request, req: _Request, engines: list[EngineState], body: dict,
                     prefill: Optional[tuple[Decision, str, bool]] = None) -> web.StreamResponse:
        """Pick an engine and forward ``body`` to it; one retry elsewhere on a failure before
        the first byte.  ``prefill``: the decode hop of a two-hop request (by load alone)."""
        tried: set[str] = set()
        for attempt in (0, 1):
            picked = self._pick(req, engines, tried, "least_loaded" if prefill else None,
                                counts=prefill is None)
            if isinstance(picked, web.Response):
                return picked
            d, state = picked
            headers = self._decision_headers(d, state.id, req.approximate, attempt > 0, prefill)
            try:
                return await self._forward(request, state, req, body, headers, d.request_id)
            except _Upstream as exc:
                tried.add(state.id)
                self._failed(state, exc, attempt)
            finally:
                self._release(d, state)
        return error(502, "the engine failed before answering, and so did the retry", "upstream_error")

    async def _disaggregated(self, request: web.Request, req: _Request) -> web.StreamResponse:
        """Two hops: the prompt to a prefill engine (routed cache-aware) with max_tokens 1 and
        PREFILL_KV_PARAMS; then the request with the kv_transfer_params it returned to a
        decode engine (least loaded), whose answer is streamed through."""
        prefill = [e for e in req.engines if e.spec.role == "prefill"]
        decode = [e for e in req.engines if e.spec.role == "decode"]
        if not prefill or not decode:
            missing = "prefill" if not prefill else "decode"
            return error(503, f"the model {req.identity.model_id!r} is served disaggregated and has "
                               f"no {missing} engine now", "unavailable")
        hop = await self._prefill_hop(req, prefill)
        if isinstance(hop, web.Response):
            return hop
        d, worker, retried, params = hop
        forward = dict(req.forward)
        if params is not None:
            forward["kv_transfer_params"] = params
        return await self._route(request, req, decode, forward, prefill=(d, worker, retried))

    async def _prefill_hop(self, req: _Request, engines: list[EngineState]):
        """(decision, prefill engine id, retried, kv_transfer_params or None), or the answer to give
        the client (no engine, or the engine's own error).  The prefill engine's load is
        released as soon as it has answered."""
        body = {**req.forward, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_KV_PARAMS)}
        body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        tried: set[str] = set()
        for attempt in (0, 1):
            picked = self._pick(req, engines, tried, prefill_hop=True)
            if isinstance(picked, web.Response):
                return picked
            d, state = picked
            try:
                up_cm, up = await self._open(state, req.path, body, req.request_id)
                try:
                    data = await self._read_all(up)
                finally:
                    await up_cm.__aexit__(None, None, None)
                if up.status != 200:        # the engine refused the request itself: say so
                    headers = self._decision_headers(d, state.id, req.approximate, attempt > 0)
                    return web.Response(status=up.status, body=data, headers={
                        **{k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}, **headers})
                self.router.first_token(d.request_id)
                self.router.predict(state.id, req.identity, req.hashes)
                params = _kv_transfer_params(data)
                if params is None:
                    # Not a KV producer: the decode engine will prefill itself (vLLM's proxy does
                    # the same); counted, so that an operator sees the misconfiguration.
                    self.metrics.upstream_errors.labels(state.id, "kv_transfer").inc()
                    log.warning("prefill engine %s answered without kv_transfer_params", state.id)
                return d, state.id, attempt > 0, params
            except _Upstream as exc:
                tried.add(state.id)
                self._failed(state, exc, attempt)
            finally:
                self._release(d, state)
        return error(502, "the prefill engine failed before answering, and so did the retry", "upstream_error")

    async def _open(self, state: EngineState, path: str, body: dict, request_id: str):
        """POST ``body`` to the engine; (context manager, response) once its head arrived.
        Raises _Upstream when it cannot be reached or answers 5xx."""
        g = self.cfg.gateway
        try:
            up_cm = self.gw.session.post(state.spec.url + path, json=body, headers={"X-Request-Id": request_id},
                                       timeout=aiohttp.ClientTimeout(total=None, connect=g.connect_timeout,
                                                                     sock_read=g.first_byte_timeout))
            up = await up_cm.__aenter__()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            state.down_until = time.monotonic() + UNHEALTHY_RETRY_S
            raise _Upstream("connect", f"{type(exc).__name__}: {exc}") from None
        if up.status >= 500:
            try:
                text = (await up.content.read(4096)).decode("utf-8", "replace")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                text = ""
            finally:
                await up_cm.__aexit__(None, None, None)
            raise _Upstream("status", f"HTTP {up.status}: {text[:200]}")
        return up_cm, up

    async def _forward(self, request, state: EngineState, req: _Request, body: dict, headers: dict, rid: str):
        up_cm, up = await self._open(state, req.path, body, req.request_id)
        try:
            passthrough = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}
            if up.status != 200 or not req.stream:
                data = await self._read_all(up)
                resp = web.Response(status=up.status, body=data, headers={**passthrough, **headers})
                if up.status == 200:
                    self.router.first_token(rid)
                    self.router.predict(state.id, req.identity, req.hashes)
                return resp
            resp = web.StreamResponse(status=200, headers={**passthrough, **headers})
            resp.headers.setdefault("Content-Type", "text/event-stream")
            await resp.prepare(request)            # the decision headers go out now
            await self._pump(request, up, resp, state, rid, req)
            return resp
        finally:
            await up_cm.__aexit__(None, None, None)

    async def _read_all(self, up) -> bytes:
        try:
            data = await read_at_most(up, MAX_UPSTREAM_BODY)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise _Upstream("body", f"{type(exc).__name__}: {exc}") from None
        if data is None:
            raise _Upstream("body", f"the answer is larger than {MAX_UPSTREAM_BODY} bytes")
        return data

    async def _send(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> bool:
        """Write to the client; False when it took nothing for [gateway] client_send_timeout
        (it stopped reading): its connection is then dropped, which frees the request."""
        try:
            async with asyncio.timeout(self.cfg.gateway.client_send_timeout):
                await resp.write(data)
            return True
        except TimeoutError:
            self.metrics.client_timeouts.labels("send").inc()
            log.info("a client stopped reading its answer for %gs: dropped", self.cfg.gateway.client_send_timeout)
            if request.transport is not None:
                request.transport.abort()
            return False

    async def _pump(self, request: web.Request, up, resp, state: EngineState, rid: str, req: _Request) -> None:
        """Pass the SSE stream through chunk by chunk; end it cleanly if the engine dies, drop
        a client that stops reading."""
        g = self.cfg.gateway
        t_first = t_last = None
        events = 0
        ended = False
        try:
            while True:
                try:
                    async with asyncio.timeout(g.idle_timeout):      # a timer, not a task per chunk
                        chunk = await up.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    self.metrics.upstream_errors.labels(state.id, "stream").inc()
                    log.warning("engine %s broke off a stream: %s", state.id, type(exc).__name__)
                    await self._send(request, resp, sse_error(f"the engine {state.id} stopped mid-answer "
                                                f"({type(exc).__name__})"))
                    return
                if not chunk:
                    ended = True
                    break
                now = time.monotonic()
                n = chunk.count(b"data:")
                if t_first is None and _role_only(chunk):
                    n = 0                              # chat's opening role chunk is no token
                elif t_first is None:
                    t_first = now
                    self.router.first_token(rid)
                    # The prefill is done: the prefix is in the engine's cache from now on.
                    self.router.predict(state.id, req.identity, req.hashes)
                    self.metrics.ttft.observe(now - req.t_arrival)
                elif n:
                    self.metrics.itl.observe((now - t_last) / n)
                if n:
                    t_last = now
                    events += n
                if not await self._send(request, resp, chunk):
                    up.close()                     # the engine sees the client go: it aborts
                    return
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
            self.metrics.disconnects.inc()
            raise
        finally:
            if ended and t_first is not None:
                tokens = max(events - 2, 0)           # minus the role chunk and [DONE], roughly
                tpot = (t_last - t_first) / tokens if tokens > 1 else None
                self.metrics.on_stream_done(t_first - req.t_arrival, tpot, g.slo_ttft, g.slo_tpot)


def _kv_transfer_params(data: bytes) -> Optional[dict]:
    """The non-empty ``kv_transfer_params`` object of a prefill engine's answer, else None."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    return params if isinstance(params, dict) and params else None

