"""What the gateway answers by itself, in the OpenAI error shape: error bodies, the middleware
that gives unknown paths and wrong methods a JSON answer, and the body fields a client may
not set; and the bounded read of an engine's answer.

An OpenAI error: ``{"error": {"message": ..., "type": ..., "code": <HTTP status>}}``.
"""
from __future__ import annotations

import json
from typing import Optional

from aiohttp import web

__all__ = ["error", "sse_error", "json_errors", "ENGINE_INTERNAL_FIELDS", "strip_internal", "read_at_most"]

# Body fields that are the engines' own plumbing, never a client's to set: vLLM's KV-transfer
# handshake (it names another request's KV blocks) and request id, SGLang's request id,
# disaggregation bootstrap and data-parallel rank.  The gateway sets kv_transfer_params itself
# for its prefill/decode hops and the request id as X-Request-Id.
ENGINE_INTERNAL_FIELDS = ("kv_transfer_params", "request_id", "rid", "bootstrap_host", "bootstrap_port",
                          "bootstrap_room", "data_parallel_rank")

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "unavailable"}


async def read_at_most(resp, limit: int) -> Optional[bytes]:
    """An upstream answer's whole body (``aiohttp.ClientResponse``), read to its end in 64 KiB
    chunks (``read()`` of the stream stops at a chunk), or None as soon as it passes ``limit``
    bytes.  Connection errors and timeouts propagate."""
    chunks, n = [], 0
    while True:
        chunk = await resp.content.read(1 << 16)
        if not chunk:
            return b"".join(chunks)
        n += len(chunk)
        if n > limit:
            return None
        chunks.append(chunk)


def error(status: int, message: str, kind: str, headers: Optional[dict] = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def sse_error(message: str) -> bytes:
    event = {"error": {"message": message, "type": "upstream_error", "code": 502}}
    return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"


def strip_internal(body: dict) -> tuple[dict, list[str]]:
    """The body without the engine-internal fields, and the names of those it had."""
    found = [f for f in ENGINE_INTERNAL_FIELDS if f in body]
    if not found:
        return body, found
    return {k: v for k, v in body.items() if k not in ENGINE_INTERNAL_FIELDS}, found


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 4xx answers (no such path, wrong method, body too large) as JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {}
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
            message = f"{request.method} is not allowed on {request.path} (allowed: {', '.join(allowed)})"
            headers["Allow"] = ",".join(allowed)
        else:
            message = exc.reason or exc.text or "error"
        return error(exc.status, message, _KINDS.get(exc.status, "invalid_request_error"), headers or None)
