"""The client's I/O-free pieces: limits and defaults, the request description ``Req`` that a
flow yields and a client executes, and the conversions of addresses, tokens and buffers.

Nothing here touches a socket; ``ops`` builds requests from them, ``sync`` and ``aio`` send them.
"""
from __future__ import annotations

import struct
from typing import Any, Callable, NamedTuple, Sequence

from quillcache._native import bufpool
from quillcache.net import parse_hostport
from quillcache.errors import (
    STATUS_CLASSES, InvalidArgument, QuillCacheError, error_for_status,
)
from quillcache.protocol.connection import Reply


__all__ = [
    "DEFAULT_TIMEOUT_S", "LIST_PAGE", "CLIENT_NAME", "GET_MANY_BUFFER_BYTES",
    "MIN_SOCKET_TIMEOUT_S", "DEFAULT_SPIN_US", "MAX_SPIN_US", "MAX_REPLY_PAYLOAD", "SHM_PUT_MIN_BYTES",
    "UNIX_PREFIX", "Req", "resolve_address",
    "token_bytes", "payload_view", "dest_view", "timeval", "pack_buffers", "status_error", "chunks", "keys_per_request",
    "sized_spans", "KEY_LIST_FIXED", "KEY_OVERHEAD", "SIZED_KEY_OVERHEAD", "Batch", "Post"
]

DEFAULT_TIMEOUT_S = 10.0         # seconds: connect and every wait for a reply
LIST_PAGE = 1024                 # keys asked per LIST request (capped at the server's max_batch)
CLIENT_NAME = "quillcache-py"
GET_MANY_BUFFER_BYTES = 8 << 20  # bytes: get_many packs consecutive values into buffers of at most this
MIN_SOCKET_TIMEOUT_S = 0.001     # seconds: the smallest SO_RCVTIMEO set (0 would mean "forever")
# microseconds a sync client's receive polls before it sleeps (Client(spin_us=...)): a reply that
# comes meanwhile skips both sides' wake-up.  1 KiB GET/PUT round trips on loopback here, p50:
# 78-103 us blocking, 31-34 us polling 50 or 100 us, no gain at 20 (docs/protocol.md).
DEFAULT_SPIN_US = 100.0
MAX_SPIN_US = 10_000.0           # microseconds: the longest poll a client may ask for
MAX_REPLY_PAYLOAD = 4 << 30      # largest reply payload a client takes (a server may announce less)
# bytes: a mapped client's single put of a smaller value goes over the Unix socket as one PUT
# (one round trip, the payload copied through the socket) instead of RESERVE, a memcpy into the
# slot and COMMIT (two round trips).  Measured on the 2-core development machine, best of 3 x 300
# puts, shm / socket time: 1 KiB 1.80, 16 KiB 1.66, 64 KiB 1.28, 256 KiB 0.89, 1 MiB 0.58
# (docs/shm.md).
SHM_PUT_MIN_BYTES = 128 << 10




UNIX_PREFIX = "unix:"            # Client("unix:/path/quillcached.sock"): the node's Unix socket


def resolve_address(address) -> "tuple[str, int] | str":
    """(host, port) for TCP, or the socket path (a str) for ``unix:/path``."""
    if isinstance(address, str) and address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX):]
        if not path:
            raise InvalidArgument(f"address {address!r}: unix: needs a socket path")
        return path
    if isinstance(address, tuple):
        return address[0], int(address[1])
    try:
        return parse_hostport(address)
    except ValueError as exc:
        raise InvalidArgument(f"address {address!r}: {exc}") from None


def token_bytes(token) -> bytes:
    if token is None:
        return b""
    if isinstance(token, str):
        return token.encode("utf-8")
    return bytes(token)


def payload_view(data) -> memoryview:
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise InvalidArgument("data must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def dest_view(buffer) -> memoryview:
    mv = memoryview(buffer)
    if mv.readonly:
        raise InvalidArgument("get_into: the buffer is read-only")
    if not mv.c_contiguous:
        raise InvalidArgument("get_into: the buffer is not C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def timeval(seconds: float) -> bytes:
    seconds = max(seconds, MIN_SOCKET_TIMEOUT_S)
    sec = int(seconds)
    return struct.pack("@ll", sec, int((seconds - sec) * 1e6))


def pack_buffers(sizes: list[int]) -> list[tuple[Any, list[memoryview]]]:
    """Consecutive values packed into buffers of at most GET_MANY_BUFFER_BYTES (a larger
    value gets its own): ``[(buffer, [view of each value in it])]``, in order.  The buffers
    are not zero-filled: the reply is received into every byte of them.  They come from the
    process's pool of receive buffers (``_native/bufpool.pyx``): memory an earlier reply
    already touched, given back when the last view of it goes."""
    out: list = []
    group: list[int] = []
    total = 0

    def close() -> None:
        buf = bufpool.take(total)
        mv = memoryview(buf)
        views, pos = [], 0
        for n in group:
            views.append(mv[pos:pos + n])
            pos += n
        out.append((buf, views))

    for n in sizes:
        if group and total + n > GET_MANY_BUFFER_BYTES:
            close()
            group, total = [], 0
        group.append(n)
        total += n
    if group:
        close()
    return out


def status_error(status: int, what: str) -> QuillCacheError:
    """The exception of one item's status in a PUT_MANY/GET_MANY reply (no ERROR body to read)."""
    name = STATUS_CLASSES.get(status, QuillCacheError).__name__
    return error_for_status(status, f"{what}: status {status} ({name})")


class Req(NamedTuple):
    opcode: int
    header: bytes
    views: Sequence[Any]
    flags: int
    into: Any                               # destination or callable(frame), or None
    finish: Callable[[Reply], Any]          # OK reply -> result (errors raised before)


class Post(NamedTuple):
    """A request sent and not waited for (what a flow yields for a client's ``_post``): its
    reply is dropped when it comes, read on the way by the next request's wait.  For a
    RELEASE after a located read has copied its bytes: the node frees the leases when it
    reads the request, and nothing the caller does depends on the answer.  With no room in
    the in-flight window for it and one more request, the client waits for it as for a
    ``Req``.  Its result in the flow is None."""
    req: Req


class Batch(NamedTuple):
    """Requests sent pipelined and ``combine``d into one result: what a flow yields for
    a client's ``_exec_many`` (``Req`` for one ``_exec``)."""
    reqs: list
    combine: Callable[[list], Any]


def chunks(seq: Sequence, n: int) -> list:
    return [seq[i:i + n] for i in range(0, len(seq), n)] or [seq[:0]]


KEY_LIST_FIXED = 16              # bytes of a batched request's header besides its keys (a u32 count, ...)
KEY_OVERHEAD = 2                 # bytes per key in a key list besides the key (its u16 length)
SIZED_KEY_OVERHEAD = 10          # ... in a sized key list (PUT_MANY, RESERVE: u16 length, u64 size)


def sized_spans(sizes: Sequence[int], per: int, max_total: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive requests of at most ``per`` items whose sizes sum to at most
    ``max_total`` (an item larger than that alone is a request of its own: the encoder names it)."""
    spans, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= per or total + n > max_total):
            spans.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        spans.append((start, len(sizes)))
    return spans


def keys_per_request(ekeys: Sequence[bytes], limits, overhead: int = KEY_OVERHEAD) -> int:
    """Keys per batched request for these encoded keys: at most the server's ``max_batch``, and
    few enough that the header body stays within its ``max_header_bytes`` (64 KiB by default:
    about 400 keys of 150 bytes, fewer than ``max_batch``).  Sized by the longest key."""
    if not ekeys:
        return limits.max_batch
    longest = max(map(len, ekeys)) + overhead
    return max(1, min(limits.max_batch, (limits.max_header_bytes - KEY_LIST_FIXED) // longest))
