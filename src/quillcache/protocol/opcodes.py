"""The constants of the QuillCache wire protocol: opcodes, flags, status codes, limits.

The frame-level constants (magic, version, sizes, FLAG_REPLY, FLAG_PAYLOAD_CRC,
OP_ERROR) live in the codec, which needs them in C; they are re-exported here so
protocol users import everything from one place.  docs/protocol.md is the spec.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from quillcache._native.codec import (
    CRC_SIZE, FIXED_PREFIX_SIZE, FLAG_PAYLOAD_CRC, FLAG_REPLY, FRAME_OVERHEAD, MAGIC,
    MAX_REQUEST_ID, OP_ERROR, PROTOCOL_VERSION,
)
from quillcache.errors import (
    STATUS_CLASSES, Busy, CapacityError, ConfigError, ConnectionLost, InvalidArgument, NotFound,
    PermissionDenied, ProtocolError, QuillCacheError, ReadOnlyError, Timeout, UnsafeReuse,
)

__all__ = [
    "Opcode", "Flag", "Status", "PinMode", "InfoFormat", "Violation", "ProtocolLimits",
    "MAGIC", "PROTOCOL_VERSION", "MIN_PROTOCOL_VERSION", "FIXED_PREFIX_SIZE", "CRC_SIZE",
    "FRAME_OVERHEAD", "FLAG_REPLY", "FLAG_PAYLOAD_CRC", "FLAG_DURABLE", "KNOWN_FLAGS",
    "OP_ERROR", "MAX_REQUEST_ID", "REQUEST_OPCODES", "PAYLOAD_REQUEST_OPCODES",
    "PAYLOAD_REPLY_OPCODES", "CLUSTER_OPCODES", "MiB", "KiB",
]

KiB = 1 << 10
MiB = 1 << 20

MIN_PROTOCOL_VERSION = 1    # oldest version this build negotiates in HELLO


class Opcode(enum.IntEnum):
    """Request opcodes; an OK reply carries the request's opcode with FLAG_REPLY."""

    HELLO = 0x01        # version negotiation + auth token
    PING = 0x02         # liveness; the payload (if any) is echoed
    PUT = 0x10          # one key, payload = the block
    GET = 0x11          # one key, reply payload = the block
    PUT_MANY = 0x12     # n keys + sizes, payload = the blocks concatenated
    GET_MANY = 0x13     # n keys, reply: per-key status + size, payload = found blocks concatenated
    EXISTS = 0x14       # n keys, reply: present prefix length + bitmap
    REMOVE = 0x15       # n keys, reply: bitmap of removed
    PIN = 0x16          # n keys + mode + ttl, reply: bitmap of pinned
    UNPIN = 0x17        # n keys + mode, reply: bitmap of unpinned
    LIST = 0x18         # scope/prefix scan, reply: keys
    STATS = 0x20        # INFO-style text or JSON, reply payload = UTF-8 body
    # located (shared-memory) operations, Unix socket only: protocol/located.py, docs/shm.md
    MAP = 0x30          # reply carries the arena's memfd by SCM_RIGHTS (trusted clients)
    GET_LOCATED = 0x31  # n keys, reply: lease id + per-key (status, offset, length) in the arena
    RELEASE = 0x32      # n lease ids, reply: how many were held
    RESERVE = 0x33      # n keys + sizes, reply: reserve id + per-key slot offset
    COMMIT = 0x34       # reserve id (+ DURABLE), reply: per-key status
    ABORT = 0x35        # reserve id, reply: empty
    ROUTE = 0x50        # tokens or block hashes + identity, reply: worker + per-block plan
    ROUTE_UPDATE = 0x51  # a routed request's first token or end (the router's load feedback)
    # node-to-node (cluster/, docs/cluster.md, docs/security.md): a connection logs in as a
    # node by NODE_AUTH + NODE_PROOF (challenge and response on the cluster credential)
    ANNOUNCE = 0x40     # holder -> home: these keys are held by (node, epoch)
    WITHDRAW = 0x41     # holder -> home: these keys are no longer held by (node, epoch)
    LOCATE = 0x42       # -> home: the holders of n keys
    FETCH = 0x43        # -> holder: n keys for a tenant, reply: per-key status + size, payload = blocks
    # operator ops (any client; keys are checked against the connection's tenant)
    CLUSTER_LOCATE = 0x44   # n keys -> JSON: each key's home and holders
    CLUSTER_VIEW = 0x45     # -> JSON: the members this node sees, their epochs and state
    NODE_AUTH = 0x46    # node login, step 1: the initiator's nonce; reply: the responder's nonce + MAC
    NODE_PROOF = 0x47   # node login, step 2: the initiator's MAC
    REPLICATE = 0x48    # holder -> replica: keep a copy of these blocks (the replica fetches them)
    ERROR = OP_ERROR    # reply only: status in the fixed header, message in the body

    INFO = 0x20         # alias of STATS


class Flag(enum.IntFlag):
    REPLY = FLAG_REPLY              # the frame is a reply
    PAYLOAD_CRC = FLAG_PAYLOAD_CRC  # a CRC32C trailer follows the payload
    DURABLE = 0x0004                # PUT/PUT_MANY: reply only once the data is durable (WAL fsync)


FLAG_DURABLE = int(Flag.DURABLE)
KNOWN_FLAGS = int(Flag.REPLY | Flag.PAYLOAD_CRC | Flag.DURABLE)

REQUEST_OPCODES = frozenset(op for op in Opcode if op is not Opcode.ERROR)
PAYLOAD_REQUEST_OPCODES = frozenset({Opcode.PUT, Opcode.PUT_MANY, Opcode.PING})
PAYLOAD_REPLY_OPCODES = frozenset({Opcode.GET, Opcode.GET_MANY, Opcode.PING, Opcode.STATS, Opcode.FETCH})
CLUSTER_OPCODES = frozenset(op for op in Opcode if 0x40 <= op <= 0x4F)   # handled by cluster.hook


# The wire name of each error class; the numbers are the classes' own ``status`` (errors.py,
# the one place they are defined, with STATUS_CLASSES mapping them back).
_STATUS_NAMES = {
    QuillCacheError: "INTERNAL", InvalidArgument: "INVALID_ARGUMENT", NotFound: "NOT_FOUND",
    UnsafeReuse: "UNSAFE_REUSE", PermissionDenied: "PERMISSION_DENIED", CapacityError: "CAPACITY",
    ProtocolError: "PROTOCOL", ConnectionLost: "CONNECTION_LOST", ReadOnlyError: "READ_ONLY",
    Timeout: "TIMEOUT", Busy: "BUSY", ConfigError: "CONFIG",
}
assert set(_STATUS_NAMES) == set(STATUS_CLASSES.values()), "a status class without a wire name"

Status = enum.IntEnum("Status", [("OK", 0)] + [(name, cls.status) for cls, name in _STATUS_NAMES.items()],
                      module=__name__)
Status.__doc__ = "Status codes: 0 is success, the rest are quillcache.errors classes (``status``)."


class PinMode(enum.IntEnum):
    SOFT = 0    # eviction prefers other blocks; may still go under pressure
    HARD = 1    # never evicted while pinned (counts against the tenant's pin quota)


class InfoFormat(enum.IntEnum):
    TEXT = 0    # "# Section" + "key:value" lines, like redis INFO
    JSON = 1


class Violation(enum.IntEnum):
    """The UnsafeReuse violation carried by an ERROR reply (0 for other errors)."""

    NONE = 0
    MODEL = 1
    TOKENIZER = 2
    ADAPTER = 3


def _positive(name: str, value: object, upper: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
        raise InvalidArgument(f"ProtocolLimits.{name} = {value!r}: must be an integer in 1..{upper}")


@dataclass(frozen=True, slots=True)
class ProtocolLimits:
    """Every limit of one connection; checked before anything is allocated.

    The server announces its limits in the HELLO reply; a client adopts them.
    """

    max_header_bytes: int = 8 * MiB         # variable header of one frame (a full batch of big keys fits)
    max_payload_bytes: int = 256 * MiB      # payload of one frame (PUT_MANY of many blocks)
    max_batch: int = 1024                   # keys in one batched request
    max_in_flight: int = 256                # requests accepted and not yet replied, per connection
    max_key_bytes: int = 4096               # one encoded key
    max_message_bytes: int = 4096           # UTF-8 of an ERROR message (longer ones are cut)
    max_token_bytes: int = 4096             # HELLO auth token
    max_collect_bytes: int = 1 * MiB        # a request payload with no destination (PING, or a PUT the
                                            # server does not place) is buffered in memory up to this

    def __post_init__(self) -> None:
        _positive("max_header_bytes", self.max_header_bytes, 0xFFFFFFFF)
        _positive("max_payload_bytes", self.max_payload_bytes, (1 << 63) - 1)
        _positive("max_batch", self.max_batch, 0xFFFFFFFF)
        _positive("max_in_flight", self.max_in_flight, 1 << 20)
        _positive("max_key_bytes", self.max_key_bytes, 0xFFFF)
        _positive("max_message_bytes", self.max_message_bytes, 0xFFFF)
        _positive("max_token_bytes", self.max_token_bytes, 0xFFFF)
        _positive("max_collect_bytes", self.max_collect_bytes, (1 << 63) - 1)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
