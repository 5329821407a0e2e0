"""ROUTE on the wire: the routing policies in their wire order (a ROUTE request names one by
index + 1), and the ROUTE / ROUTE_UPDATE bodies.  The policies themselves live in
``quillcache.control.router``; the wire layer only needs their names, so it imports nothing
from the control plane.

``IDENTITY_BLIND``: the policies that credit a prefix whoever cached it.  A request may not
name one (its answer would tell another tenant's prompt); only the operator's config may.
A reply carries only figures of the request's own identity: no count of blocks another
identity holds (docs/security.md).
"""
from __future__ import annotations

import struct
import sys
from typing import NamedTuple, Sequence

from quillcache.errors import InvalidArgument
from quillcache.protocol.body import DEFAULT_LIMITS, F64, U16, U32, BodyReader, BytesLike, write_text16
from quillcache.protocol.opcodes import ProtocolLimits

__all__ = ["POLICIES", "IDENTITY_BLIND", "RouteRequest", "RouteReply", "encode_route_request",
           "decode_route_request", "encode_route_reply", "decode_route_reply", "encode_route_update",
           "decode_route_update", "ROUTE_TOKENS", "ROUTE_HASHES", "ROUTE_FIRST_TOKEN", "ROUTE_FREE",
           "ROUTE_POLICIES", "ROUTE_TRACK", "MAX_ROUTE_TEXT"]

# Append new policies at the end: a ROUTE request names one by its place in this tuple.
POLICIES = ("round_robin", "least_loaded", "prefix", "dynamo", "quillcache", "sglang", "llmd", "mooncake")
# The peers as their projects ship them credit a prefix whoever cached it (control/policies.py).
IDENTITY_BLIND = frozenset({"dynamo", "sglang", "llmd", "mooncake"})


# --------------------------------------------------------------------------- ROUTE (0x50, 0x51)
#
# ROUTE request:  u8 kind (0 token ids, 1 router block hashes) | u8 policy (0 = the node's,
#   i = ROUTE_POLICIES[i - 1]) | u8 flags (bit 0: track the request's load) | text16 tenant,
#   model, tokenizer, adapter ("" = none) | text16 request_id ("" = the router names it) |
#   u32 request_tokens (0 = from the items) | u32 count | count * (u32 token id | i64 hash)
# ROUTE reply:    text16 worker | text16 request_id | u32 block_size | f64 credited_blocks |
#   u32 device, host, disk, pool | u32 n + n plan bytes | u16 workers + workers * (text16 name +
#   f64 logit); every figure is of the request's own identity
# ROUTE_UPDATE request: u8 event (1 first token, 2 free) | text16 request_id;  reply: u8 known

ROUTE_TOKENS, ROUTE_HASHES = 0, 1
ROUTE_TRACK = 0x01
ROUTE_FIRST_TOKEN, ROUTE_FREE = 1, 2
ROUTE_POLICIES = POLICIES       # wire order: policy code i names ROUTE_POLICIES[i - 1]
MAX_ROUTE_TEXT = 255            # bytes of one identity field or request id
_ROUTE_HEAD = struct.Struct("<BBB")
_ROUTE_COUNTS = struct.Struct("<II")
_ROUTE_REPLY = struct.Struct("<Id4I")


class RouteRequest(NamedTuple):
    kind: int
    policy: str | None
    track: bool
    tenant: str
    model: str
    tokenizer: str
    adapter: str | None
    request_id: str | None
    request_tokens: int
    items: list[int]


class RouteReply(NamedTuple):
    worker: str
    request_id: str
    block_size: int
    credited_blocks: float
    device: int
    host: int
    disk: int
    pool: int
    plan: bytes
    logits: dict[str, float]


def _items_array(kind: int):
    from array import array
    return array("I" if kind == ROUTE_TOKENS else "q")


def encode_route_request(kind: int, tenant: str, model: str, tokenizer: str, adapter: str | None,
                         items: Sequence[int], *, policy: str | None = None, track: bool = True,
                         request_id: str | None = None, request_tokens: int = 0,
                         limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    what = "ROUTE"
    if kind not in (ROUTE_TOKENS, ROUTE_HASHES):
        raise InvalidArgument(f"{what}: kind {kind} (0 token ids, 1 block hashes)")
    if policy is not None and policy not in ROUTE_POLICIES:
        raise InvalidArgument(f"{what}: policy {policy!r} (one of {', '.join(ROUTE_POLICIES)})")
    if not 0 <= request_tokens < (1 << 32):
        raise InvalidArgument(f"{what}: request_tokens {request_tokens} out of 0..2**32-1")
    out = bytearray(_ROUTE_HEAD.pack(kind, 0 if policy is None else ROUTE_POLICIES.index(policy) + 1,
                                     ROUTE_TRACK if track else 0))
    for field, text in (("tenant", tenant), ("model", model), ("tokenizer", tokenizer),
                        ("adapter", adapter or ""), ("request_id", request_id or "")):
        write_text16(out, text, MAX_ROUTE_TEXT, what, field)
    arr = _items_array(kind)
    try:
        arr.extend(items)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"{what}: items must be {'u32 token ids' if kind == ROUTE_TOKENS else 'i64 hashes'}"
                              f" ({exc})") from None
    if sys.byteorder != "little":
        arr.byteswap()
    out += _ROUTE_COUNTS.pack(request_tokens, len(arr))
    out += arr.tobytes()
    if len(out) > limits.max_header_bytes:
        raise InvalidArgument(f"{what}: {len(out)} bytes of header, at most {limits.max_header_bytes} "
                              "(send the router's block hashes instead of the token ids)")
    return bytes(out)


def decode_route_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> RouteRequest:
    r = BodyReader(body, "ROUTE")
    kind, policy_code, flags = r.unpack(_ROUTE_HEAD, "head")
    if kind not in (ROUTE_TOKENS, ROUTE_HASHES):
        raise InvalidArgument(f"ROUTE: kind {kind} (0 token ids, 1 block hashes)")
    if policy_code > len(ROUTE_POLICIES):
        raise InvalidArgument(f"ROUTE: policy code {policy_code} (0..{len(ROUTE_POLICIES)})")
    tenant, model, tokenizer, adapter, rid = (r.text16(f, MAX_ROUTE_TEXT) for f in
                                              ("tenant", "model", "tokenizer", "adapter", "request_id"))
    request_tokens, count = r.unpack(_ROUTE_COUNTS, "counts")
    width = 4 if kind == ROUTE_TOKENS else 8
    raw = r.take(count * width, "items")        # checked against the bytes present first
    r.end()
    arr = _items_array(kind)
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return RouteRequest(kind, ROUTE_POLICIES[policy_code - 1] if policy_code else None,
                        bool(flags & ROUTE_TRACK), tenant, model, tokenizer, adapter or None,
                        rid or None, request_tokens, arr.tolist())


def encode_route_reply(reply: RouteReply) -> bytes:
    out = bytearray()
    write_text16(out, reply.worker, MAX_ROUTE_TEXT, "ROUTE reply", "worker")
    write_text16(out, reply.request_id, MAX_ROUTE_TEXT, "ROUTE reply", "request_id")
    out += _ROUTE_REPLY.pack(reply.block_size, reply.credited_blocks, reply.device, reply.host, reply.disk,
                             reply.pool)
    out += U32.pack(len(reply.plan))
    out += reply.plan
    out += U16.pack(len(reply.logits))
    for name, logit in reply.logits.items():
        write_text16(out, name, MAX_ROUTE_TEXT, "ROUTE reply", "worker")
        out += F64.pack(logit)
    return bytes(out)


def decode_route_reply(body: BytesLike) -> RouteReply:
    r = BodyReader(body, "ROUTE reply")
    worker = r.text16("worker", MAX_ROUTE_TEXT)
    rid = r.text16("request_id", MAX_ROUTE_TEXT)
    block_size, credited, dev, host, disk, pool = r.unpack(_ROUTE_REPLY, "decision")
    plan = r.take(r.u32("plan length"), "plan")
    logits = {}
    for _ in range(r.u16("workers")):
        name = r.text16("worker", MAX_ROUTE_TEXT)
        logits[name] = r.unpack(F64, "logit")[0]
    r.end()
    return RouteReply(worker, rid, block_size, credited, dev, host, disk, pool, plan, logits)


def encode_route_update(event: int, request_id: str) -> bytes:
    if event not in (ROUTE_FIRST_TOKEN, ROUTE_FREE):
        raise InvalidArgument(f"ROUTE_UPDATE: event {event} (1 first token, 2 free)")
    out = bytearray((event,))
    write_text16(out, request_id, MAX_ROUTE_TEXT, "ROUTE_UPDATE", "request_id")
    return bytes(out)


def decode_route_update(body: BytesLike) -> tuple[int, str]:
    r = BodyReader(body, "ROUTE_UPDATE")
    event = r.u8("event")
    if event not in (ROUTE_FIRST_TOKEN, ROUTE_FREE):
        raise InvalidArgument(f"ROUTE_UPDATE: event {event} (1 first token, 2 free)")
    rid = r.text16("request_id", MAX_ROUTE_TEXT)
    r.end()
    return event, rid
