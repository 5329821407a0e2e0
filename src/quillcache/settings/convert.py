"""The converters of settings: each takes a TOML value and returns the setting's value, or
raises ``ConversionError`` saying what a good value looks like (``not a byte size (e.g. "4GiB")``).

Shared by the node's settings and the gateway's, so a size, a duration or a tenant list is
read the same way in both files.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, NamedTuple, Optional

from quillcache.net import ConversionError, parse_hostport

__all__ = [
    "ConversionError", "parse_byte_size", "format_byte_size", "parse_duration", "format_duration",
    "hash_token", "boolean", "string", "choice", "int_range", "fraction", "size_range", "nonneg_float",
    "positive_float", "Tenant", "tenants", "endpoints", "ident", "advertise", "duration_range",
    "ETCD_CLIENT_PORT",
]

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


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConversionError("not a boolean (true or false)")


def string(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConversionError('not a string (e.g. "node-1")')


def choice(*choices: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise ConversionError("not one of " + ", ".join(f'"{c}"' for c in choices))
    convert.choices = choices  # type: ignore[attr-defined]
    return convert


def int_range(lo: int, hi: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConversionError(f"not an integer in {lo}..{hi}")
        return value
    return convert


def fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConversionError("not a fraction in (0, 1] (e.g. 0.9)")
    return float(value)


def size_range(lo: int, hi: int) -> Callable[[Any], int]:
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


def nonneg_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1e9:
        raise ConversionError("not a number >= 0 (e.g. 0.75)")
    return float(value)


def positive_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1e9:
        raise ConversionError("not a number > 0 (e.g. 1.5)")
    return float(value)


class Tenant(NamedTuple):
    """One ``[[auth.tenants]]`` table.  A tuple, read by position where only the first
    fields matter (auth.py: name, token, shm, may_act_for)."""

    name: str
    token: str                          # "sha256:<64 hex>"
    shm: bool = False                   # its Unix-socket clients may map the DRAM arena
    may_act_for: tuple[str, ...] = ()   # tenants whose keys it may name (an engine), or ("*",)
    pin_bytes: Optional[int] = None     # bytes its hard pins may hold; None: an even share (docs/tiering.md)


_TENANT_KEYS = {"name", "token", "shm", "may_act_for", "pin_bytes"}


def tenants(value: Any) -> tuple[Tenant, ...]:
    example = '[[auth.tenants]] name = "acme" token = "sha256:<64 hex>" (quillctl auth hash-token)'
    if not isinstance(value, list):
        raise ConversionError(f"not a list of tenants (e.g. {example})")
    seen = set()
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not {"name", "token"} <= set(item) <= _TENANT_KEYS:
            raise ConversionError(f"entry {i} must have name and token, and may have shm, may_act_for "
                                  f"and pin_bytes (e.g. {example})")
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
        pin_bytes = None
        if "pin_bytes" in item:
            try:
                pin_bytes = parse_byte_size(item["pin_bytes"])
            except ConversionError as exc:
                raise ConversionError(f"entry {i}: pin_bytes: {exc}") from None
        seen.add(name)
        out.append(Tenant(name, token, bool(item.get("shm")), tuple(act), pin_bytes))
    return tuple(out)


ETCD_CLIENT_PORT = 2379     # etcd's client port: an endpoint written without one gets it


def endpoints(value: Any) -> tuple[tuple[str, int], ...]:
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


def ident(value: Any) -> str:
    if isinstance(value, str) and _TENANT_RE.match(value):
        return value
    raise ConversionError('not 1-64 of A-Z a-z 0-9 _ . - (e.g. "pool-1")')


def advertise(value: Any) -> Any:
    return value if value == "" else parse_hostport(value)


def duration_range(lo: float, hi: float) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        seconds = parse_duration(value)
        if not lo <= seconds <= hi:
            raise ConversionError(f"out of range {format_duration(lo)}..{format_duration(hi)} (e.g. \"3s\")")
        return seconds
    return convert
