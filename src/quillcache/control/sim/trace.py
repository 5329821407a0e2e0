"""Mooncake-format traces: loading with clear errors, and the seeded tenant assignment.

A trace is JSON lines ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [block ids]}`` (``input_tokens`` and ``output_tokens`` are read as the lengths too):
each id names the content of one ``TRACE_BLOCK_TOKENS``-token block, and equal ids are equal
content (a shared prefix).

A trace cut in blocks of another size (a generator's ``block_size``) is read with its size
(``block_tokens``) and re-cut into ``TRACE_BLOCK_TOKENS``-token blocks: each new block is
named by the block before it and the ids of the blocks it overlaps, so two requests share a
new block exactly when they share every block of theirs up to its end.

What other producers of the format write is read as they mean it (AIPerf's ``mooncake_trace``
dataset): a row without ``hash_ids`` is a prompt that shares nothing (it gets ids no other row
has), and rows out of time order are replayed in time order (with a ``TraceWarning``). A row
that gives its prompt as text (``text_input``, ``messages``) has no token counts to replay
and is refused, as is one timed only by a ``delay`` after the turn before.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["TraceRequest", "TraceError", "TraceWarning", "load_trace", "parse_trace", "assign_tenants",
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


class TraceWarning(UserWarning):
    """A trace replayed otherwise than in the order its lines are written."""


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
    if value is None:
        text = [k for k in ("text_input", "messages") if k in rec] if name == "input_length" else []
        if text:
            raise TraceError(f"{where}: the prompt is given as {text[0]}, without input_length: the replay "
                             f"needs each prompt's length in tokens (and hash_ids for what it shares)")
        raise TraceError(f"{where}: no {name}" + (f" (nor {alias})" if alias else "")
                         + f": an integer in {lo}..{hi} is needed")
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
    rows: list[tuple[float, int, int, Optional[tuple[int, ...]]]] = []   # ids None: shares nothing
    latest, back = -1.0, 0          # back: the first line whose timestamp goes back in time
    for lineno, line in enumerate(lines, 1):
        if limit and len(rows) >= limit and not back:
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
        if ts is None:
            if "delay" in rec:
                raise TraceError(f"{where}: no timestamp: a row timed by its delay after the turn before (a "
                                 f"session's) is not replayed; the replay sends at absolute times, so give it one")
            raise TraceError(f"{where}: no timestamp: the replay sends each request at its timestamp (ms)")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < float("inf"):
            raise TraceError(f"{where}: timestamp {ts!r}: must be a number of ms >= 0")
        n_in = _field_int(rec, "input_length", where, 1, MAX_TRACE_TOKENS)
        n_out = _field_int(rec, "output_length", where, 1, MAX_TRACE_TOKENS)
        ids = rec.get("hash_ids")
        if ts < latest and not back:
            back = lineno
        latest = max(latest, float(ts))
        if ids is None:                  # no prefix named: a prompt of its own (AIPerf's reading)
            rows.append((float(ts), n_in, n_out, None))
            continue
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
        rows.append((float(ts), n_in, n_out, tuple(ids) if recut is None else recut(ids, n_in)))
    if back:
        # A stable sort: rows of one timestamp keep their order.  With a limit the whole trace
        # was read, so the first ``limit`` rows are the first in time.
        rows.sort(key=lambda row: row[0])
        del rows[limit or len(rows):]
        warnings.warn(f"{name}:{back}: timestamps go back in time: the {len(rows)} requests are replayed "
                      f"in time order", TraceWarning, stacklevel=2)
    return [TraceRequest(i, ts, n_in, n_out, ids) for i, (ts, n_in, n_out, ids) in enumerate(_own_ids(rows))]


def _own_ids(rows: list) -> list:
    """``rows`` with each row that names no hash_ids given ids of its own, one per
    ``TRACE_BLOCK_TOKENS`` tokens, none of them any other row's."""
    if all(row[3] is not None for row in rows):
        return rows
    used = {h for row in rows if row[3] is not None for h in row[3]}
    fresh = (h for h in range(1 << 64) if h not in used)
    return [row if row[3] is not None else
            (*row[:3], tuple(next(fresh) for _ in range(-(-row[1] // TRACE_BLOCK_TOKENS)))) for row in rows]


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
