"""Mooncake-format traces: loading with clear errors, and the seeded tenant assignment.

A trace is JSON lines ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [block ids]}`` (``input_tokens`` and ``output_tokens`` are read as the lengths too):
each id names the content of one ``TRACE_BLOCK_TOKENS``-token block, and equal ids are equal
content (a shared prefix).

A trace cut in blocks of another size (a generator's ``block_size``) is read with its size
(``block_tokens``) and re-cut into ``TRACE_BLOCK_TOKENS``-token blocks: each new block is
named by the block before it and the ids of the blocks it overlaps, so two requests share a
new block exactly when they share every block of theirs up to its end.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["TraceRequest", "TraceError", "load_trace", "parse_trace", "assign_tenants",
           "conversation_keys", "TRACE_BLOCK_TOKENS", "HUB_CHILDREN", "MAX_TRACE_LINE"]

TRACE_BLOCK_TOKENS = 512        # tokens per hash_id in Mooncake traces
MAX_TRACE_LINE = 1 << 22        # bytes per JSON line
MAX_TRACE_TOKENS = 1 << 24      # per request, input or output
# A prefix node with more than this many distinct next blocks is a shared prefix (a system
# prompt, a shared document) rather than one conversation's history; see conversation_keys.
HUB_CHILDREN = 8


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake record (the message names the line).
    ``fits``: where its hash_ids are too many or too few, the block sizes they would fit."""

    def __init__(self, message: str, fits: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.fits = tuple(fits)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str = "t0"


# Other names some producers write for the same fields (Dynamo's trace tools read them too).
_ALIASES = {"input_length": "input_tokens", "output_length": "output_tokens"}


def _field_int(rec: dict, name: str, where: str, lo: int, hi: int) -> int:
    value = rec.get(name)
    alias = _ALIASES.get(name)
    if alias is not None and alias in rec:
        if name in rec and rec[alias] != value:
            raise TraceError(f"{where}: {name} {value!r} and {alias} {rec[alias]!r} disagree")
        value = rec[alias]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TraceError(f"{where}: {name} {value!r}: must be an integer in {lo}..{hi}")
    return value


def _fitting_block_sizes(n_tokens: int, n_ids: int) -> list[int]:
    """The power-of-two block sizes (16 to 4,096 tokens) that cut ``n_tokens`` into ``n_ids``
    blocks: what a record's block size could be, for an error that says so."""
    return [b for b in (1 << k for k in range(4, 13)) if -(-n_tokens // b) == n_ids]


class _Recut:
    """Re-cuts hash ids of ``src``-token blocks into ``TRACE_BLOCK_TOKENS``-token blocks, with
    the ids it hands out interned across the trace (one entry per distinct new block)."""

    def __init__(self, src: int) -> None:
        self.src = src
        self.ids: dict[tuple, int] = {}

    def __call__(self, ids: list[int], n_tokens: int) -> tuple[int, ...]:
        out: list[int] = []
        prev = -1
        for j in range(-(-n_tokens // TRACE_BLOCK_TOKENS)):
            lo = j * TRACE_BLOCK_TOKENS // self.src
            hi = (min((j + 1) * TRACE_BLOCK_TOKENS, n_tokens) - 1) // self.src
            prev = self.ids.setdefault((prev, *ids[lo:hi + 1]), len(self.ids))
            out.append(prev)
        return tuple(out)


def parse_trace(lines: Iterable[str], name: str = "trace", limit: int = 0,
                block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    """The trace's records, checked line by line.  ``block_tokens``: the tokens per hash id in
    this trace; ids of another size than ``TRACE_BLOCK_TOKENS`` are re-cut (module docstring)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
            or not 1 <= block_tokens <= MAX_TRACE_TOKENS:
        raise ValueError(f"block_tokens {block_tokens!r}: an integer in 1..{MAX_TRACE_TOKENS}")
    recut = _Recut(block_tokens) if block_tokens != TRACE_BLOCK_TOKENS else None
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if limit and len(out) >= limit:
            break
        where = f"{name}:{lineno}"
        if len(line) > MAX_TRACE_LINE:
            raise TraceError(f"{where}: line of {len(line)} bytes (at most {MAX_TRACE_LINE})")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: a record must be a JSON object")
        ts = rec.get("timestamp")
        if ts is None and "delay" in rec:
            raise TraceError(f"{where}: no timestamp: a row timed by its delay after the turn before (a "
                             f"session's) is not replayed; the replay sends at absolute times, so give it one")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise TraceError(f"{where}: timestamp {ts!r}: must be a number of ms >= 0")
        n_in = _field_int(rec, "input_length", where, 1, MAX_TRACE_TOKENS)
        n_out = _field_int(rec, "output_length", where, 1, MAX_TRACE_TOKENS)
        ids = rec.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                and 0 <= h < 1 << 64 for h in ids):
            raise TraceError(f"{where}: hash_ids must be a list of integers in 0..2**64-1")
        expect = -(-n_in // block_tokens)
        if len(ids) != expect:
            fits = _fitting_block_sizes(n_in, len(ids))
            raise TraceError(f"{where}: {len(ids)} hash_ids for input_length {n_in} "
                             f"(expected {expect} blocks of {block_tokens} tokens"
                             + (f"; blocks of {' or '.join(map(str, fits))} tokens fit" if fits else "") + ")",
                             fits)
        if out and ts < out[-1].timestamp_ms:
            raise TraceError(f"{where}: timestamp {ts} goes back in time (previous "
                             f"{out[-1].timestamp_ms})")
        out.append(TraceRequest(len(out), float(ts), n_in, n_out,
                                tuple(ids) if recut is None else recut(ids, n_in)))
    return out


def load_trace(path: str, limit: int = 0, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    with open(path, encoding="utf-8") as f:
        return parse_trace(f, name=path, limit=limit, block_tokens=block_tokens)


def conversation_keys(requests: Sequence[TraceRequest]) -> list[tuple[int, ...]]:
    """Each request's conversation: the chain of hash_ids down to the first block that
    follows the shared prefixes.

    The prefix tree of all requests' hash_ids is built; a node with more than
    ``HUB_CHILDREN`` distinct children is a hub (content many conversations share, like a
    system prompt: the trace's root is one when every request starts differently).  A
    request's key is its path down to and including the first block below the last hub on
    the path, so the turns of one conversation (each extending the previous prompt) share a
    key, and a trace with no shared prefix keys each request by its first block.
    """
    node_of: dict[tuple[int, int], int] = {}     # (parent node, hash_id) -> node
    fanout = [0]                                 # node -> distinct children (node 0: root)
    paths = []
    for req in requests:
        node = 0
        path = []
        for h in req.hash_ids:
            child = node_of.get((node, h))
            if child is None:
                child = node_of[(node, h)] = len(fanout)
                fanout.append(0)
                fanout[node] += 1
            path.append(node)
            node = child
        paths.append(path)
    keys = []
    for req, path in zip(requests, paths, strict=False):
        cut = 1
        for depth, node in enumerate(path):
            if fanout[node] > HUB_CHILDREN:
                cut = depth + 1
        keys.append(req.hash_ids[:cut])
    return keys


def assign_tenants(requests: Sequence[TraceRequest], tenants: int, seed: int) -> list[TraceRequest]:
    """Give each conversation to one of ``tenants`` tenants by a seeded hash of its key.
    Content is untouched: the shared prefixes stay shared in content across tenants."""
    if not isinstance(tenants, int) or tenants < 1:
        raise TraceError(f"tenants {tenants!r}: must be at least 1")
    if tenants == 1:
        return [_with_tenant(r, "t0") for r in requests]
    out = []
    salt = seed.to_bytes(8, "big", signed=True)
    for req, key in zip(requests, conversation_keys(requests), strict=False):
        digest = hashlib.blake2b(salt + b",".join(str(h).encode() for h in key),
                                 digest_size=8).digest()
        out.append(_with_tenant(req, f"t{int.from_bytes(digest, 'big') % tenants}"))
    return out


def _with_tenant(req: TraceRequest, tenant: str) -> TraceRequest:
    return TraceRequest(req.index, req.timestamp_ms, req.input_length, req.output_length,
                        req.hash_ids, tenant)
