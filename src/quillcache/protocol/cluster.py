"""The node-to-node messages (opcodes 0x40-0x48), encoded and decoded with the checks of
``protocol.messages``: every count and length is checked against the limits before a
list is built.  docs/cluster.md is the spec, docs/security.md says who may send what.

Integers are little-endian.  ``text8`` = u8 length + UTF-8; ``keys`` = u32 count + count
x (u16 length + encoded key), as in GET_MANY.  ``crc`` is the CRC32C of the block's bytes
as the node that stored them computed it: it travels with the block's record (ANNOUNCE,
LOCATE, REPLICATE), and a reader checks the bytes it fetched against it.

ANNOUNCE  text8 node, u64 epoch, u32 n, n x (u16 klen, key, u64 size, u32 crc)   reply: empty
WITHDRAW  text8 node, u64 epoch, keys                                    reply: empty
LOCATE    keys           reply: u32 n, n x (u8 m, m x (text8 node, u64 epoch, u64 size, u32 crc))
FETCH     text8 tenant, keys   reply: u64 holder epoch, u32 n, n x (u8 status, u64 size);
                               payload = the found blocks in order
NODE_AUTH   text8 initiator, u64 epoch, text8 responder, nonce[32]
            reply: text8 responder, u64 epoch, nonce[32], mac[32]
NODE_PROOF  mac[32]                                                      reply: empty
REPLICATE   u32 n, n x (u16 klen, key, u64 size, u32 crc)   (the sender holds them: fetch them)
CLUSTER_LOCATE  keys           reply: u32 length + JSON
CLUSTER_VIEW    empty          reply: u32 length + JSON

A node opens a connection to another with HELLO whose token is ``NODE_HELLO_TOKEN`` (a
fixed marker, not a secret: it grants nothing), then NODE_AUTH and NODE_PROOF
(transfer/tcp.py); the credential is never sent.
"""
from __future__ import annotations

import hmac
import json
import secrets
import struct
from typing import Any, NamedTuple, Optional, Sequence

from quillcache._native.codec import decode_key_list
from quillcache.errors import InvalidArgument, PermissionDenied
from quillcache.protocol.messages import BodyReader, encode_keys_request
from quillcache.protocol.opcodes import Opcode, ProtocolLimits

__all__ = [
    "encode_announce", "decode_announce", "encode_withdraw", "decode_withdraw",
    "encode_locate", "decode_locate", "encode_locate_reply", "decode_locate_reply",
    "encode_fetch", "decode_fetch", "encode_fetch_reply", "decode_fetch_reply",
    "encode_json", "decode_json", "MAX_HOLDERS", "Holder", "NODE_HELLO_TOKEN", "NODE_OPCODES",
    "encode_node_auth", "decode_node_auth", "encode_node_auth_reply", "decode_node_auth_reply",
    "encode_node_proof", "decode_node_proof", "encode_replicate", "decode_replicate",
    "encode_cluster_view", "encode_cluster_locate", "NodeLogin",
]

NODE_HELLO_TOKEN = b"quillcache-node-login/1"    # HELLO token of a node about to log in (not a secret)
NONCE_BYTES = 32
MAC_BYTES = 32
# What a node sends another: the node login decides who may (cluster/hook.py), not the
# server's tenant check; a connection logged in as a node may send nothing else.
NODE_OPCODES = frozenset({Opcode.ANNOUNCE, Opcode.WITHDRAW, Opcode.LOCATE, Opcode.FETCH, Opcode.REPLICATE,
                          Opcode.NODE_AUTH, Opcode.NODE_PROOF})

MAX_HOLDERS = 255           # holders named per key in a LOCATE reply (u8)
MAX_JSON_BYTES = 16 << 20   # a CLUSTER_* reply body

_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_H = struct.Struct("<H")
_BQ = struct.Struct("<BQ")
_QQI = struct.Struct("<QQI")
_QI = struct.Struct("<QI")
_names: dict[str, bytes] = {}           # node id -> its text8 bytes (a LOCATE reply names few nodes)
_names_read: dict[bytes, str] = {}      # the other way, for the decoder
_holder_items: dict[tuple[str, int, int, int], bytes] = {}   # (node, epoch, size, crc) -> its reply bytes
_COUNTS = [bytes((i,)) for i in range(MAX_HOLDERS + 1)]


class Holder(NamedTuple):
    """One holder of a block as LOCATE answers it: the node, the epoch of its run, the block's
    size and the CRC32C its writer computed when it stored the bytes."""
    node_id: str
    epoch: int
    size: int
    crc: int


def _name(node_id: str) -> bytes:
    raw = _names.get(node_id)
    if raw is None:
        b = bytearray()
        _text8(b, node_id, "node id")
        raw = bytes(b)
        if len(_names) < 4096:
            _names[node_id] = raw
    return raw


def _keys_at(buf, pos: int, limits: ProtocolLimits, what: str) -> list[bytes]:
    """The ``keys`` list starting at ``buf[pos]`` and ending the body, with the checks of
    ``messages.decode_keys_request`` (in the codec: one pass, no reader)."""
    return decode_key_list(buf, pos, limits.max_batch, limits.max_key_bytes, what)


def _text8(out: bytearray, text: str, field: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise InvalidArgument(f"{field} {text!r}: at most 255 bytes of UTF-8")
    out.append(len(raw))
    out += raw


def _read_text8(r: BodyReader, field: str) -> str:
    n = r.u8(field + " length")
    try:
        return r.take(n, field).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{r.what}: {field} is not UTF-8") from None


def _check_count(n: int, limits: ProtocolLimits, what: str) -> None:
    if n > limits.max_batch:
        raise InvalidArgument(f"{what}: batch of {n} items, at most {limits.max_batch}")


# ---------------------------------------------------------------- ANNOUNCE / WITHDRAW

def _blocks(out: bytearray, items: Sequence[tuple[bytes, int, int]], limits: ProtocolLimits, what: str) -> None:
    """u32 n, n x (u16 klen, key, u64 size, u32 crc)."""
    _check_count(len(items), limits, what)
    out += _I.pack(len(items))
    for key, size, crc in items:
        if not 0 < len(key) <= limits.max_key_bytes:
            raise InvalidArgument(f"{what}: key of {len(key)} bytes")
        out += _H.pack(len(key))
        out += key
        out += _QI.pack(size, crc)


def _read_blocks(r: BodyReader, limits: ProtocolLimits) -> list[tuple[bytes, int, int]]:
    n = r.count(limits, 2 + 1 + _QI.size)
    items = []
    for _ in range(n):
        key = r.key(limits)
        size, crc = r.unpack(_QI, "size and crc")
        items.append((key, size, crc))
    r.end()
    return items


def encode_announce(node_id: str, epoch: int, items: Sequence[tuple[bytes, int, int]],
                    limits: ProtocolLimits) -> bytes:
    """``items``: (encoded key, size, crc) of blocks ``node_id`` holds in run ``epoch``."""
    out = bytearray()
    _text8(out, node_id, "node id")
    out += _Q.pack(epoch)
    _blocks(out, items, limits, "ANNOUNCE")
    return bytes(out)


def decode_announce(body, limits: ProtocolLimits) -> tuple[str, int, list[tuple[bytes, int, int]]]:
    r = BodyReader(body, "ANNOUNCE")
    node = _read_text8(r, "node id")
    epoch = r.u64("epoch")
    return node, epoch, _read_blocks(r, limits)


def encode_replicate(items: Sequence[tuple[bytes, int, int]], limits: ProtocolLimits) -> bytes:
    """REPLICATE: the sender (the connection's node) holds these blocks; fetch and keep them."""
    out = bytearray()
    _blocks(out, items, limits, "REPLICATE")
    return bytes(out)


def decode_replicate(body, limits: ProtocolLimits) -> list[tuple[bytes, int, int]]:
    return _read_blocks(BodyReader(body, "REPLICATE"), limits)


def encode_withdraw(node_id: str, epoch: int, keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    out = bytearray()
    _text8(out, node_id, "node id")
    out += _Q.pack(epoch)
    return bytes(out) + encode_keys_request(keys, limits, "WITHDRAW")


def decode_withdraw(body, limits: ProtocolLimits) -> tuple[str, int, list[bytes]]:
    r = BodyReader(body, "WITHDRAW")
    node = _read_text8(r, "node id")
    epoch = r.u64("epoch")
    return node, epoch, _keys_at(r.buf, r.pos, limits, "WITHDRAW")


# ---------------------------------------------------------------- LOCATE

def encode_locate(keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    return encode_keys_request(keys, limits, "LOCATE")


def decode_locate(body, limits: ProtocolLimits, what: str = "LOCATE") -> list[bytes]:
    return _keys_at(body, 0, limits, what)


def encode_locate_reply(per_key: Sequence[Sequence[Holder]], limits: ProtocolLimits) -> bytes:
    """``per_key``: (node id, epoch, size, crc) per holder (``Holder`` or plain tuples) per key."""
    _check_count(len(per_key), limits, "LOCATE reply")
    parts = [_I.pack(len(per_key))]
    append = parts.append
    encoded = _holder_items
    for holders in per_key:
        if len(holders) > MAX_HOLDERS:
            holders = holders[:MAX_HOLDERS]
        append(_COUNTS[len(holders)])
        for h in holders:
            raw = encoded.get(h)
            if raw is None:
                raw = _holder_item(h)
            append(raw)
    return b"".join(parts)


def _holder_item(h) -> bytes:
    """One holder as a LOCATE reply names it: text8 node, u64 epoch, u64 size, u32 crc."""
    node_id, epoch, size, crc = h
    raw = _name(node_id) + _QQI.pack(epoch, size, crc)
    if len(_holder_items) < 4096:
        _holder_items[tuple(h)] = raw
    return raw


def decode_locate_reply(body, limits: ProtocolLimits) -> list[list[Holder]]:
    """The holders of each key; every count and length is checked before it is used, as
    ``BodyReader`` would (one loop over the bytes: this runs on every located miss)."""
    buf = bytes(body)
    end = len(buf)
    if end < 4:
        raise InvalidArgument("LOCATE reply: body truncated in count")
    n = int.from_bytes(buf[:4], "little")
    if n > limits.max_batch:
        raise InvalidArgument(f"LOCATE reply: batch of {n} items, at most {limits.max_batch}")
    if n > end - 4:
        raise InvalidArgument(f"LOCATE reply: count {n} needs at least {n} bytes, the body has {end - 4} left")
    pos = 4
    names = _names_read
    unpack = _QQI.unpack_from
    item = _QQI.size
    out = []
    append = out.append
    for _ in range(n):
        if pos >= end:
            raise InvalidArgument("LOCATE reply: body truncated in holder count")
        m = buf[pos]
        pos += 1
        holders = []
        for _ in range(m):
            if pos >= end:
                raise InvalidArgument("LOCATE reply: body truncated in node id length")
            ln = buf[pos]
            stop = pos + 1 + ln
            if stop + item > end:
                raise InvalidArgument("LOCATE reply: body truncated in holder")
            raw = buf[pos + 1:stop]
            node = names.get(raw)
            if node is None:
                try:
                    node = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidArgument("LOCATE reply: node id is not UTF-8") from None
                if len(names) < 4096:
                    names[raw] = node
            epoch, nbytes, crc = unpack(buf, stop)
            holders.append(Holder(node, epoch, nbytes, crc))
            pos = stop + item
        append(holders)
    if pos != end:
        raise InvalidArgument(f"LOCATE reply: {end - pos} trailing bytes in the body")
    return out


# ---------------------------------------------------------------- FETCH

def encode_fetch(tenant: str, keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    out = bytearray()
    _text8(out, tenant, "tenant")
    return bytes(out) + encode_keys_request(keys, limits, "FETCH")


def decode_fetch(body, limits: ProtocolLimits) -> tuple[str, list[bytes]]:
    r = BodyReader(body, "FETCH")
    tenant = _read_text8(r, "tenant")
    return tenant, _keys_at(r.buf, r.pos, limits, "FETCH")


def encode_fetch_reply(epoch: int, items: Sequence[tuple[int, int]], limits: ProtocolLimits) -> bytes:
    _check_count(len(items), limits, "FETCH reply")
    out = bytearray(_Q.pack(epoch))
    out += _I.pack(len(items))
    for status, size in items:
        out += _BQ.pack(status, size)
    return bytes(out)


def decode_fetch_reply(body, limits: ProtocolLimits, payload_length: int) -> tuple[int, list[tuple[int, int]]]:
    """(holder epoch, [(status, size)]); the sizes of the found items must add up to
    ``payload_length``."""
    r = BodyReader(body, "FETCH reply")
    epoch = r.u64("epoch")
    n = r.count(limits, _BQ.size)
    items = [r.unpack(_BQ, "item") for _ in range(n)]
    r.end()
    total = sum(size for status, size in items if status == 0)
    if total != payload_length:
        raise InvalidArgument(f"FETCH reply: items add up to {total} bytes, the payload has {payload_length}")
    return epoch, items


# ---------------------------------------------------------------- node login

def encode_node_auth(initiator: str, epoch: int, responder: str, nonce: bytes) -> bytes:
    out = bytearray()
    _text8(out, initiator, "node id")
    out += _Q.pack(epoch)
    _text8(out, responder, "node id")
    out += _fixed(nonce, NONCE_BYTES, "nonce")
    return bytes(out)


def decode_node_auth(body) -> tuple[str, int, str, bytes]:
    r = BodyReader(body, "NODE_AUTH")
    initiator = _read_text8(r, "initiator")
    epoch = r.u64("epoch")
    responder = _read_text8(r, "responder")
    nonce = bytes(r.take(NONCE_BYTES, "nonce"))
    r.end()
    return initiator, epoch, responder, nonce


def encode_node_auth_reply(responder: str, epoch: int, nonce: bytes, mac: bytes) -> bytes:
    out = bytearray()
    _text8(out, responder, "node id")
    out += _Q.pack(epoch)
    out += _fixed(nonce, NONCE_BYTES, "nonce")
    out += _fixed(mac, MAC_BYTES, "mac")
    return bytes(out)


def decode_node_auth_reply(body) -> tuple[str, int, bytes, bytes]:
    r = BodyReader(body, "NODE_AUTH reply")
    responder = _read_text8(r, "responder")
    epoch = r.u64("epoch")
    nonce = bytes(r.take(NONCE_BYTES, "nonce"))
    mac = bytes(r.take(MAC_BYTES, "mac"))
    r.end()
    return responder, epoch, nonce, mac


def encode_node_proof(mac: bytes) -> bytes:
    return _fixed(mac, MAC_BYTES, "mac")


def decode_node_proof(body) -> bytes:
    r = BodyReader(body, "NODE_PROOF")
    mac = bytes(r.take(MAC_BYTES, "mac"))
    r.end()
    return mac


class NodeLogin:
    """The initiator's side of a node login, without I/O: ``request()`` is NODE_AUTH's body,
    ``proof(reply)`` checks NODE_AUTH's reply and returns NODE_PROOF's body, or raises
    PermissionDenied when the responder did not prove the key (then send nothing more).
    ``keys``: the pool's ``cluster.keys.ClusterKeys``."""

    def __init__(self, keys, node_id: str, epoch: int, peer_id: str) -> None:
        self.keys, self.node_id, self.epoch, self.peer_id = keys, node_id, epoch, peer_id
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.peer_epoch: Optional[int] = None

    def request(self) -> bytes:
        return encode_node_auth(self.node_id, self.epoch, self.peer_id, self.nonce)

    def proof(self, reply_body) -> bytes:
        responder, peer_epoch, peer_nonce, mac = decode_node_auth_reply(reply_body)
        transcript = (self.node_id, self.epoch, self.peer_id, peer_epoch, self.nonce, peer_nonce)
        if responder != self.peer_id or not hmac.compare_digest(mac, self.keys.responder_mac(*transcript)):
            raise PermissionDenied(f"node login: the node at {self.peer_id!r}'s address did not prove "
                                   "it holds the cluster credential")
        self.peer_epoch = peer_epoch
        return encode_node_proof(self.keys.initiator_mac(*transcript))


def _fixed(raw: bytes, n: int, field: str) -> bytes:
    raw = bytes(raw)
    if len(raw) != n:
        raise InvalidArgument(f"{field} of {len(raw)} bytes, must be {n}")
    return raw


# ---------------------------------------------------------------- operator requests and replies

def encode_cluster_view() -> bytes:
    """CLUSTER_VIEW's request body: empty."""
    return b""


def encode_cluster_locate(keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    """CLUSTER_LOCATE's request body: the encoded keys."""
    return encode_keys_request(keys, limits, "CLUSTER_LOCATE")


def encode_json(obj: Any) -> bytes:
    raw = json.dumps(obj, sort_keys=True).encode("utf-8")
    if len(raw) > MAX_JSON_BYTES:
        raise InvalidArgument(f"reply of {len(raw)} bytes of JSON, at most {MAX_JSON_BYTES}")
    return _I.pack(len(raw)) + raw


def decode_json(body) -> Any:
    r = BodyReader(body, "cluster reply")
    n = r.u32("length")
    if n > MAX_JSON_BYTES:
        raise InvalidArgument(f"cluster reply: {n} bytes of JSON, at most {MAX_JSON_BYTES}")
    raw = r.take(n, "JSON")
    r.end()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"cluster reply: bad JSON ({exc})") from None
