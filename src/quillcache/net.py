"""Addresses: the node's default address and the one parser of ``host:port`` every part uses.

Lowest layer beside ``model`` and ``errors``: the clients, the settings and the node import it,
it imports nothing of quillcache.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any

__all__ = ["DEFAULT_ADDRESS", "DEFAULT_UNIX_SOCKET", "ConversionError", "parse_hostport", "format_hostport"]

DEFAULT_ADDRESS = "127.0.0.1:7470"   # [node] listen's default, and where clients connect by default
# [node] unix_socket of the shipped config and systemd unit (RuntimeDirectory=quillcache, group
# quillcache, 0750: docs/shm.md); an engine's connector with no address tries it before TCP.
# The embedded default (`make run`) is <data_dir>/quillcached.sock instead: no /run as a user.
DEFAULT_UNIX_SOCKET = "/run/quillcache/quillcached.sock"


class ConversionError(ValueError):
    """A value that a converter refuses; the message says what a good one looks like."""


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
