"""The settings registry and TOML configuration.

One registry (``SETTINGS``) names every setting: section, key, converter, default,
whether SIGHUP can reload it, and help text.  It drives validation of config
files, the sample config (``conf/quillcache.toml``, ``quillctl config sample``)
and the ``quillcache.toml(5)`` man page, so the three never drift apart.

Errors name the file, the section, the key and the bad value with an example
of a good one::

    quillcache.toml: [store] dram = "12Q": not a byte size (e.g. "4GiB")
"""
from __future__ import annotations

import difflib
import hashlib
import ipaddress
import re
import tomllib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from quillcache.errors import ConfigError
from quillcache.exitcodes import CONFIG as EX_CONFIG  # the exit code of a bad config

__all__ = [
    "Setting", "SETTINGS", "SECTIONS", "Config", "ConfigError", "load_config", "parse_config",
    "render_sample", "parse_byte_size", "parse_duration", "parse_hostport", "format_byte_size",
    "format_duration", "hash_token", "EX_CONFIG", "DEFAULT_ADDRESS", "Registry", "NODE_REGISTRY",
]

DEFAULT_ADDRESS = "127.0.0.1:7470"   # [node] listen's default, and where clients connect by default


class ConversionError(ValueError):
    """A value that a converter refuses; the message says what a good one looks like."""


# --------------------------------------------------------------------------- converters

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: Any) -> int:
    """``4GiB``, ``512MiB``, ``64k``, ``1.5GiB`` or a plain integer of bytes."""
    if isinstance(value, bool):
        raise ConversionError('not a byte size (e.g. "4GiB")')
    if isinstance(value, int):
        if value < 0:
            raise ConversionError('a byte size cannot be negative (e.g. "4GiB")')
        return value
    if not isinstance(value, str):
        raise ConversionError('not a byte size (e.g. "4GiB")')
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConversionError('not a byte size (e.g. "4GiB")')
    number = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    result = number * _SIZE_UNITS[m.group(2).lower()]
    if result != int(result):
        raise ConversionError('not a whole number of bytes (e.g. "4GiB")')
    return int(result)


def format_byte_size(n: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ns|us|µs|ms|s|m|h)\s*$")


def parse_duration(value: Any) -> float:
    """``200ms``, ``10s``, ``1.5m``, ``500us`` -> seconds (float)."""
    if isinstance(value, bool):
        raise ConversionError('not a duration (e.g. "200ms" or "10s")')
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConversionError('a duration cannot be negative (e.g. "10s")')
        return float(value)
    if not isinstance(value, str):
        raise ConversionError('not a duration (e.g. "200ms" or "10s")')
    m = _DURATION_RE.match(value)
    if not m:
        raise ConversionError('not a duration (e.g. "200ms" or "10s")')
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def format_duration(seconds: float) -> str:
    for unit, factor in (("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        value = seconds / factor
        if seconds >= factor and abs(value - round(value)) < 1e-9:
            return f"{int(round(value))}{unit}"
    return "0s" if seconds == 0 else f"{seconds}s"


def parse_hostport(value: Any) -> tuple[str, int]:
    """``127.0.0.1:7470``, ``[::1]:7470`` or ``localhost:7470``."""
    if not isinstance(value, str):
        raise ConversionError('not a host:port (e.g. "127.0.0.1:7470")')
    m = re.match(r"^\[([0-9a-fA-F:.]+)\]:([0-9]+)$", value) or re.match(r"^([^:\s\[\]]+):([0-9]+)$", value)
    if not m:
        raise ConversionError('not a host:port (e.g. "127.0.0.1:7470")')
    host, port = m.group(1), int(m.group(2))
    if not 0 <= port <= 65535:
        raise ConversionError('port out of range 0..65535 (e.g. "127.0.0.1:7470")')
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConversionError('not a host:port (e.g. "[::1]:7470")') from None
    return host, port


def format_hostport(hp: tuple[str, int]) -> str:
    host, port = hp
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConversionError("not a boolean (true or false)")


def _string(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConversionError('not a string (e.g. "node-1")')


def _choice(*choices: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise ConversionError("not one of " + ", ".join(f'"{c}"' for c in choices))
    convert.choices = choices  # type: ignore[attr-defined]
    return convert


def _int_range(lo: int, hi: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConversionError(f"not an integer in {lo}..{hi}")
        return value
    return convert


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConversionError("not a fraction in (0, 1] (e.g. 0.9)")
    return float(value)


def _size_range(lo: int, hi: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        n = parse_byte_size(value)
        if not lo <= n <= hi:
            raise ConversionError(
                f"out of range {format_byte_size(lo)}..{format_byte_size(hi)} (e.g. \"{format_byte_size(lo)}\")")
        return n
    return convert


_TOKEN_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def hash_token(token: str) -> str:
    """The form a tenant token is stored in the config: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


def _router_module(value: Any) -> str:
    # The names come from the router-module registry (one place: quillcache.control.modules).
    from quillcache.control.modules import ROUTER_MODULES
    if isinstance(value, str) and value in ROUTER_MODULES:
        return value
    raise ConversionError("unknown router module; known: " + ", ".join(f'"{m}"' for m in ROUTER_MODULES))


def _nonneg_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1e9:
        raise ConversionError("not a number >= 0 (e.g. 0.75)")
    return float(value)


def _engines(value: Any) -> tuple:
    # The fields and their checks live with the router module (quillcache.control.modules).
    from quillcache.control.modules import parse_engines
    return parse_engines(value, ConversionError)


def _tenants(value: Any) -> tuple[tuple[str, str], ...]:
    example = '[[auth.tenants]] name = "acme" token = "sha256:<64 hex>" (quillctl auth hash-token)'
    if not isinstance(value, list):
        raise ConversionError(f"not a list of tenants (e.g. {example})")
    seen = set()
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not {"name", "token"} <= set(item) <= {"name", "token", "shm", "may_act_for"}:
            raise ConversionError(f"entry {i} must have name and token, and may have shm and may_act_for "
                                  f"(e.g. {example})")
        if not isinstance(item.get("shm", False), bool):
            raise ConversionError(f"entry {i}: shm must be true or false")
        act = item.get("may_act_for", [])
        if not isinstance(act, list) or not all(isinstance(a, str) and (a == "*" or _TENANT_RE.match(a))
                                                for a in act):
            raise ConversionError(f"entry {i}: may_act_for must be a list of tenant names or [\"*\"]")
        name, token = item["name"], item["token"]
        if not isinstance(name, str) or not _TENANT_RE.match(name):
            raise ConversionError(f"entry {i}: tenant name {name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if not isinstance(token, str) or not _TOKEN_HASH_RE.match(token):
            raise ConversionError(f"entry {i}: token must be stored hashed, \"sha256:<64 hex>\" "
                                  "(quillctl auth hash-token prints it); plain tokens are refused")
        if name in seen:
            raise ConversionError(f"entry {i}: tenant {name!r} is listed twice")
        seen.add(name)
        # (name, token), or (name, token, True) for a tenant whose clients may map the arena,
        # then the tenants it may act for (an engine serving many tenants), when it has any
        entry = (name, token, True) if item.get("shm") else (name, token)
        if act:
            entry = (name, token, bool(item.get("shm")), tuple(act))
        out.append(entry)
    return tuple(out)


ETCD_CLIENT_PORT = 2379     # etcd's client port: an endpoint written without one gets it


def _endpoints(value: Any) -> tuple[tuple[str, int], ...]:
    """etcd endpoints as etcd's own tools write them: a list (or one string, comma-separated
    like ``etcdctl --endpoints``) of ``host:port``, ``http://host:port`` or ``host``."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value:
        raise ConversionError('not a list of host:port (e.g. ["127.0.0.1:2379"])')
    out = []
    for v in value:
        if not isinstance(v, str):
            raise ConversionError(f"{v!r}: not a host:port (e.g. \"127.0.0.1:2379\")")
        if v.startswith("https://"):
            raise ConversionError(f"{v!r}: TLS to etcd is not supported; give an http:// endpoint "
                                  "(a local etcd gateway or proxy in front of a TLS cluster)")
        if v.startswith("http://"):
            v = v[len("http://"):].rstrip("/")
        bracketed = v.startswith("[") and v.endswith("]")             # [v6 address] alone
        if bracketed or (v and ":" not in v):
            v = f"{v}:{ETCD_CLIENT_PORT}"            # a host alone: etcd's client port
        try:
            out.append(parse_hostport(v))
        except ConversionError as exc:
            raise ConversionError(f"{v!r}: {exc}") from None
    return tuple(out)


def _ident(value: Any) -> str:
    if isinstance(value, str) and _TENANT_RE.match(value):
        return value
    raise ConversionError('not 1-64 of A-Z a-z 0-9 _ . - (e.g. "pool-1")')


def _advertise(value: Any) -> Any:
    return value if value == "" else parse_hostport(value)


def _duration_range(lo: float, hi: float) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        seconds = parse_duration(value)
        if not lo <= seconds <= hi:
            raise ConversionError(f"out of range {format_duration(lo)}..{format_duration(hi)} (e.g. \"3s\")")
        return seconds
    return convert


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True, slots=True)
class Setting:
    section: str
    name: str
    convert: Callable[[Any], Any]
    default: Any                 # the TOML value (as written in a file)
    reloadable: bool
    help: str

    @property
    def qualname(self) -> str:
        return f"{self.section}.{self.name}"


def _s(section, name, convert, default, reloadable, help_):
    return Setting(section, name, convert, default, reloadable, help_)


SECTIONS = {
    "node": "This node: its name, where it listens and where it keeps its state.",
    "store": "The DRAM tier and the limits on blocks.",
    "ssd": "The SSD tier: a preallocated data file whose extents are placed by the offset allocator.",
    "wal": "The write-ahead log that makes SSD puts and the residency index durable.",
    "limits": "Protocol limits, enforced before anything is allocated.",
    "metrics": "The Prometheus /metrics endpoint.",
    "auth": "Tenants and their tokens. With no tenants the node runs open (dev mode).",
    "router": "The routing module hosted by this node: it consumes the engines' KV events and "
              "answers ROUTE requests (docs/protocol.md).",
    "events": "This node's own KV events: its residency changes published in vLLM's KV-event "
              "format (medium cpu, topic = node id), so routers see the pool as a tier.",
    "guard": "The identity guard: who may reuse a block.",
    "index": "The residency index: the store's record of which blocks are resident in which tier.",
    "cluster": "A pool of nodes: membership on etcd, residency by rendezvous hashing, cross-node fetch.",
}

SETTINGS: tuple[Setting, ...] = (
    _s("node", "id", _string, "", False,
       "Name of this node in stats and logs; empty means the host name."),
    _s("node", "listen", parse_hostport, DEFAULT_ADDRESS, False,
       "Address of the binary protocol (TCP)."),
    _s("node", "unix_socket", _string, "", False,
       "Path of the Unix-domain socket (same protocol, mode 0660; trusted clients map the DRAM "
       "arena through it, docs/shm.md); empty means <data_dir>/quillcached.sock, \"off\" none."),
    _s("node", "shm", _bool, True, False,
       "Hand the DRAM arena to trusted clients of the Unix socket (tenants with shm = true, or "
       "everyone in open mode); false: the Unix socket copies like TCP."),
    _s("node", "data_dir", _string, "./var", False,
       "Directory for the SSD data file, the WAL and checkpoints."),
    _s("node", "log_level", _choice("debug", "info", "warning", "error"), "info", True,
       "Lowest level of the log lines written to stderr."),
    _s("node", "drain_timeout", parse_duration, "10s", True,
       "How long SIGTERM waits for in-flight requests before closing connections."),
    _s("store", "dram", _size_range(1 << 20, 1 << 50), "1GiB", False,
       "Capacity of the DRAM arena (one anonymous mapping)."),
    _s("store", "max_block", _size_range(1, 1 << 36), "64MiB", False,
       "Largest block accepted by a put; larger ones are refused before allocating."),
    _s("store", "policy", _choice("write_back", "write_through"), "write_back", True,
       "write_back: a put lands in DRAM and is demoted to SSD under pressure or by age; "
       "write_through: every put is acknowledged only after the SSD tier's durable publish."),
    _s("store", "high_watermark", _fraction, 0.9, True,
       "DRAM occupancy that starts demotion to SSD."),
    _s("store", "low_watermark", _fraction, 0.75, True,
       "DRAM occupancy that demotion brings the arena down to."),
    _s("store", "demote_after", parse_duration, "0s", True,
       "Demote blocks older than this to SSD (0s: only under pressure)."),
    _s("store", "lease", parse_duration, "10s", True,
       "How long a get holds a block against eviction and removal."),
    _s("store", "put_timeout", parse_duration, "30s", True,
       "A started put that is not finished within this is aborted and its slot reclaimed."),
    _s("store", "hugepages", _bool, False, False,
       "Ask for transparent huge pages on the DRAM arena."),
    _s("store", "prefault", _bool, False, False,
       "Touch every page of the DRAM arena at start."),
    _s("ssd", "enabled", _bool, True, False,
       "Keep an SSD tier (a put with durable=true needs it)."),
    _s("ssd", "path", _string, "", False,
       "The SSD data file; empty means <data_dir>/ssd/blocks.dat."),
    _s("ssd", "capacity", _size_range(1 << 20, 1 << 50), "4GiB", False,
       "Size of the SSD data file (preallocated)."),
    _s("ssd", "direct_io", _bool, True, False,
       "Write block bytes with O_DIRECT where the filesystem allows it."),
    _s("ssd", "verify", _choice("lazy", "eager"), "lazy", False,
       "When recovery checks each block's CRC32C: on its first read (lazy) or at start (eager)."),
    _s("ssd", "promote_on_get", _bool, True, True,
       "A get of a block only on SSD copies it into DRAM when there is room; false: DRAM is left "
       "to puts and such gets are sent from the data file (sendfile, checked end to end by the "
       "stored CRC32C)."),
    _s("ssd", "sendfile", _bool, True, False,
       "Send a GET served from the data file with sendfile(2); false: preadv into a buffer, then "
       "write (for filesystems whose sendfile is slow or missing). Used only while the tier writes "
       "with O_DIRECT (direct_io): a buffered write into a reused extent would change the pages of "
       "a reply still unread in a socket."),
    _s("wal", "sync", _choice("group", "always"), "group", False,
       "group: one vectored write and one fsync per commit window; always: one per record."),
    _s("wal", "commit_window", parse_duration, "1ms", True,
       "How long group commit gathers records before one write + fsync."),
    _s("wal", "segment_size", _size_range(1 << 20, 1 << 34), "64MiB", False,
       "Size at which the log rotates to a new segment file."),
    _s("wal", "backend", _choice("auto", "io_uring", "pwritev"), "auto", False,
       "auto uses io_uring where the kernel allows it, else pwritev + fdatasync."),
    _s("wal", "checkpoint_interval", parse_duration, "60s", True,
       "How often the residency index is checkpointed and the log truncated."),
    _s("index", "persistent", _bool, False, False,
       "Keep the residency index in a write-ahead log and checkpoints under <data_dir>/index, "
       "so a restart finds its records without rebuilding them; at start it is checked against "
       "the SSD tier, whose data wins where they disagree."),
    _s("limits", "max_header", _size_range(64, 1 << 24), "64KiB", False,
       "Largest frame header (keys and batch descriptors)."),
    _s("limits", "max_payload", _size_range(1, 1 << 40), "1GiB", False,
       "Largest frame payload (a batch of blocks)."),
    _s("limits", "max_batch", _int_range(1, 1 << 16), 1024, False,
       "Most keys in one GET_MANY, PUT_MANY or EXISTS."),
    _s("limits", "max_inflight", _int_range(1, 1 << 16), 256, False,
       "Most requests in flight on one connection."),
    _s("limits", "max_connections", _int_range(1, 1 << 20), 4096, False,
       "Most client connections at once."),
    _s("metrics", "enabled", _bool, True, False,
       "Serve Prometheus metrics."),
    _s("metrics", "listen", parse_hostport, "127.0.0.1:7471", False,
       "Address of the /metrics HTTP endpoint."),
    _s("auth", "tenants", _tenants, [], True,
       "Tenants as [[auth.tenants]] tables with name and token (a hash: quillctl auth hash-token), "
       "and shm = true where that tenant's Unix-socket clients may map the DRAM arena; "
       "may_act_for = [\"*\"] (or a list of names) lets that principal (an engine) name those tenants "
       "in its keys."),
    _s("auth", "max_failed_hellos", _int_range(1, 1 << 20), 10, True,
       "Failed HELLOs per peer address per minute before that peer is refused."),
    _s("router", "module", _router_module, "none", False,
       "Routing module hosted by this node: none (a plain store node), dynamo (Dynamo's cost "
       "function as shipped, identity-blind) or quillcache (identity-scoped credit plus pool credit)."),
    _s("router", "engines", _engines, [], False,
       "The engines to route to, as [[router.engines]] tables: id, endpoint (their ZMQ KV-event "
       "PUB socket), replay_endpoint, model, tokenizer, tenant, adapter; pool = true marks a "
       "QuillCache node's residency publisher (its blocks count as the pool tier)."),
    _s("router", "block_size", _int_range(1, 1 << 16), 16, False,
       "Tokens per block of the router's own hash chain (the engines' block size)."),
    _s("router", "prefill_load_scale", _nonneg_float, 1.0, False,
       "Weight of the prefill blocks a worker would still compute (Dynamo's prefill_load_scale)."),
    _s("router", "active_request_weight", _nonneg_float, 0.0, False,
       "Cost per active request (Dynamo's decode_active_request_weight)."),
    _s("router", "host_weight", _nonneg_float, 0.75, False,
       "Credit per overlap block in the worker's host (CPU) cache; a device block earns 1.0."),
    _s("router", "disk_weight", _nonneg_float, 0.25, False,
       "Credit per overlap block in the worker's disk cache."),
    _s("router", "pool_weight", _nonneg_float, 0.5, False,
       "Credit per block any worker can fetch from the QuillCache pool (module quillcache only)."),
    _s("router", "temperature", _nonneg_float, 0.0, False,
       "0: the cheapest worker, ties broken at random; > 0: softmax sampling over the costs."),
    _s("router", "approximate", _bool, False, False,
       "Predict residency from routing decisions, for engines that publish no KV events."),
    _s("router", "approx_ttl", parse_duration, "120s", False,
       "How long a predicted block is believed in approximate mode."),
    _s("events", "publish", _bool, False, False,
       "Publish this node's residency changes (block stored, block removed)."),
    _s("events", "endpoint", _string, "tcp://127.0.0.1:7480", False,
       "ZMQ PUB endpoint the residency events are published on."),
    _s("events", "replay_endpoint", _string, "tcp://127.0.0.1:7481", False,
       "ZMQ ROUTER endpoint that replays missed batches (empty: no replay)."),
    _s("events", "buffer_steps", _int_range(1, 1 << 22), 10000, False,
       "Batches kept for replay."),
    _s("guard", "mode", _choice("strict", "tenant", "off"), "strict", True,
       "strict: serve only an exact model, tokenizer, adapter and tenant match; tenant: tenant "
       "isolation only; off: content-hash reuse (for studies; logged loudly)."),
    _s("cluster", "enabled", _bool, False, False,
       "Join a pool of nodes; false: a single node with no etcd and no peers."),
    _s("cluster", "etcd", _endpoints, ["127.0.0.1:2379"], False,
       "The etcd endpoints that hold the membership: host:port, http://host:port or host (port 2379)."),
    _s("cluster", "cluster_id", _ident, "quillcache", False,
       "Name of the pool: nodes with the same etcd and cluster_id see each other."),
    _s("cluster", "node_id", _string, "", False,
       "This node's name in the pool; empty means [node] id, else the host name."),
    _s("cluster", "advertise", _advertise, "", False,
       "host:port that peers dial to reach this node; empty means [node] listen."),
    _s("cluster", "lease_ttl", _duration_range(1.0, 60.0), "3s", False,
       "TTL of the etcd lease under this node's record (kept alive every TTL/3); a dead node "
       "leaves the view within this."),
    _s("cluster", "hop_timeout", _duration_range(0.01, 30.0), "1s", False,
       "Deadline of one node-to-node request (locate, fetch, announce)."),
    _s("cluster", "replicas", _int_range(1, 16), 1, False,
       "Copies of each put block: the first where placement says, the others on the next "
       "nodes in rendezvous order."),
    _s("cluster", "placement", _choice("local", "hashed"), "local", False,
       "local: the node a client writes to keeps the first copy (no hop on the put path); "
       "hashed: the first copy also goes to the key's first node in rendezvous order."),
    _s("cluster", "cache_remote", _bool, True, False,
       "Keep a local copy of a block fetched from another node."),
    _s("cluster", "credential", _string, "", False,
       "Shared secret that nodes present to each other (at least 16 characters; required "
       "when enabled)."),
    _s("cluster", "reannounce_rate", _int_range(1, 1 << 24), 20000, False,
       "Records per second a node re-announces to their new homes after a membership change."),
)



class Registry:
    """The settings of one kind of configuration file: the node's, or the gateway's.

    Both are validated, sampled and documented by the same code; a program shares a
    section with another by passing the same ``Setting`` objects (``[auth]``, ``[router]``)."""

    def __init__(self, name: str, sections: Mapping[str, str], settings: Iterable[Setting],
                 check: Callable[["Config"], None] | None = None) -> None:
        self.name = name
        self.sections = dict(sections)
        self.settings = tuple(settings)
        self.by_section: dict[str, dict[str, Setting]] = {}
        for setting in self.settings:
            self.by_section.setdefault(setting.section, {})[setting.name] = setting
        missing = set(self.sections) ^ set(self.by_section)
        if missing:
            raise ValueError(f"registry {name}: sections without settings or summary: {sorted(missing)}")
        self.check = check


def _check_node(cfg: "Config") -> None:
    store = cfg.store
    if store.low_watermark >= store.high_watermark:
        raise ConfigError(
            f"{cfg.source}: [store] low_watermark = {store.low_watermark}: must be below "
            f"high_watermark = {store.high_watermark} (e.g. 0.75 and 0.9)")
    if store.max_block > store.dram:
        raise ConfigError(
            f"{cfg.source}: [store] max_block = \"{format_byte_size(store.max_block)}\": larger "
            f"than [store] dram = \"{format_byte_size(store.dram)}\" (e.g. \"64MiB\")")
    cluster = cfg.cluster
    if cluster.enabled and len(cluster.credential) < 16:
        raise ConfigError(
            f"{cfg.source}: [cluster] credential: needs at least 16 characters when [cluster] "
            "enabled = true (nodes present it to each other)")
    if cluster.enabled:
        for section, name in (("cluster", "node_id"), ("node", "id")):
            value = getattr(getattr(cfg, section), name)
            if "@" in value:
                # a home names other nodes' records "<node>@<epoch>" beside its own (cluster/records.py)
                raise ConfigError(f'{cfg.source}: [{section}] {name} = "{value}": no "@" in a node id '
                                  "when [cluster] enabled = true")


NODE_REGISTRY = Registry("quillcached", SECTIONS, SETTINGS, _check_node)
_BY_SECTION = NODE_REGISTRY.by_section


# --------------------------------------------------------------------------- resolved config


class Section:
    """Converted values of one section, as attributes (``cfg.store.dram``)."""

    __slots__ = ("_name", "_values")

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"[{self._name}] has no setting {key!r}") from None

    def __setattr__(self, key, value):
        raise AttributeError("configuration sections are read-only")

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)


class Config:
    """A validated configuration: ``raw`` holds TOML values, sections hold converted ones."""

    def __init__(self, raw: Mapping[str, Mapping[str, Any]], source: str,
                 registry: Registry = NODE_REGISTRY) -> None:
        self.source = source
        self.registry = registry
        self.raw = {s: dict(v) for s, v in raw.items()}
        self._sections = {}
        for section, settings in registry.by_section.items():
            values = {}
            for name, setting in settings.items():
                value = self.raw.get(section, {}).get(name, setting.default)
                values[name] = setting.convert(value)
            self._sections[section] = Section(section, values)
        if registry.check is not None:
            registry.check(self)

    def __getattr__(self, section: str) -> Section:
        sections = self.__dict__.get("_sections", {})
        if section in sections:
            return sections[section]
        raise AttributeError(f"no configuration section [{section}]")

    def get(self, qualname: str) -> Any:
        section, name = qualname.split(".", 1)
        return getattr(self._sections[section], name)

    def reloadable_changes(self, other: "Config") -> tuple[dict[str, Any], list[str]]:
        """What changed from self to other: (reloadable {qualname: new value}, fixed qualnames)."""
        apply, fixed = {}, []
        for setting in self.registry.settings:
            old, new = self.get(setting.qualname), other.get(setting.qualname)
            if old != new:
                if setting.reloadable:
                    apply[setting.qualname] = new
                else:
                    fixed.append(setting.qualname)
        return apply, fixed

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Config":
        """A new config with ``{"node.listen": "127.0.0.1:0"}``-style overrides (validated)."""
        raw = {s: dict(v) for s, v in self.raw.items()}
        for qualname, value in overrides.items():
            section, name = qualname.split(".", 1)
            raw.setdefault(section, {})[name] = value
        return parse_config(raw, self.source + " (with command-line overrides)", self.registry)


# --------------------------------------------------------------------------- loading


def _did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[...]"
    if isinstance(value, dict):
        return "{...}"
    return str(value)


def parse_config(raw: Mapping[str, Any], source: str = "quillcache.toml",
                 registry: Registry = NODE_REGISTRY) -> Config:
    """Validate a parsed TOML document; raises ConfigError naming source, section, key, value."""
    by_section = registry.by_section
    for section, table in raw.items():
        if section not in by_section:
            raise ConfigError(f"{source}: unknown section [{section}]{_did_you_mean(section, by_section)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section} must be a table ([{section}])")
        for name, value in table.items():
            settings = by_section[section]
            if name not in settings:
                hint = _did_you_mean(name, settings)
                if not hint:  # a key put in the wrong section
                    elsewhere = [s for s, keys in by_section.items() if name in keys]
                    if elsewhere:
                        hint = f" (it belongs in [{elsewhere[0]}])"
                raise ConfigError(f"{source}: [{section}] unknown key {name!r}{hint}")
            try:
                settings[name].convert(value)
            except ConversionError as exc:
                raise ConfigError(f"{source}: [{section}] {name} = {_show(value)}: {exc}") from None
    return Config(raw, source, registry)


def load_config(path: str | None = None, text: str | None = None, source: str | None = None,
                registry: Registry = NODE_REGISTRY) -> Config:
    """Load from a file path, from TOML text, or (neither) the embedded defaults."""
    if path is not None and text is None:
        source = source or path
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not UTF-8 text") from None
    source = source or "quillcache.toml"
    if text is None:
        return parse_config({}, "(embedded defaults)", registry)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(raw, source, registry)


# --------------------------------------------------------------------------- sample


def _toml_value(value: Any) -> str:
    if isinstance(value, list) and not value:
        return "[]"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    return _show(value)


def _wrap(text: str, width: int = 88, prefix: str = "# ") -> list[str]:
    import textwrap
    return [prefix + line for line in textwrap.wrap(text, width - len(prefix))]


def render_sample(registry: Registry = NODE_REGISTRY) -> str:
    """The full default configuration, commented from the registry's help text."""
    what = "node" if registry is NODE_REGISTRY else registry.name
    lines = [
        f"# QuillCache {what} configuration (quillcache.toml(5)).",
        "# Generated from the settings registry by `quillctl config sample`; every key is shown",
        "# with its default. Keys marked (reloadable) take effect on SIGHUP.",
    ]
    for section, summary in registry.sections.items():
        lines += ["", f"[{section}]"] + _wrap(summary)
        for setting in registry.by_section[section].values():
            note = " (reloadable)" if setting.reloadable else ""
            lines += _wrap(setting.help + note)
            lines.append(f"{setting.name} = {_toml_value(setting.default)}")
    return "\n".join(lines) + "\n"
