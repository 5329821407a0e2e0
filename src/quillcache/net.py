"""Addresses: the node's default address and the one parser of ``host:port`` every part uses;
and the TCP congestion control of same-host connections.

Lowest layer beside ``model`` and ``errors``: the clients, the settings and the node import it,
it imports nothing of quillcache.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any

__all__ = ["DEFAULT_ADDRESS", "DEFAULT_UNIX_SOCKET", "ConversionError", "parse_hostport", "format_hostport",
           "LOOPBACK_CONGESTION", "CONGESTION_NAME", "same_host", "same_host_addresses", "set_congestion",
           "system_congestion", "tune_same_host"]

DEFAULT_ADDRESS = "127.0.0.1:7470"   # [node] listen's default, and where clients connect by default
# [node] unix_socket of the shipped config and systemd unit (RuntimeDirectory=quillcache, group
# quillcache, 0750: docs/shm.md); an engine's connector with no address tries it before TCP.
# The embedded default (`make run`) is <data_dir>/quillcached.sock instead: no /run as a user.
DEFAULT_UNIX_SOCKET = "/run/quillcache/quillcached.sock"


# The congestion control of a TCP connection whose two ends are on this host ([node]
# loopback_congestion's default, and the clients'). Loopback has no bottleneck to pace for; a
# pacing algorithm there (bbr, the default of many cloud images) sends a 256 KiB reply at its
# model's rate instead of at once, and that model swings (docs/protocol.md, "Same-host TCP").
# reno is built into every kernel and always allowed, also to unprivileged processes.
LOOPBACK_CONGESTION = "reno"
CONGESTION_NAME = re.compile(r"^[a-z0-9_]{1,15}$")      # TCP_CA_NAME_MAX is 16 with its NUL
_SYSTEM_CONGESTION = "/proc/sys/net/ipv4/tcp_congestion_control"


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


def same_host_addresses(peer: str, local: str) -> bool:
    """Whether a connection from ``peer`` to ``local`` (IP address strings) stays on this host:
    the peer is a loopback address, or the socket's own (a client of this host that connected
    to one of its non-loopback addresses).  IPv4-mapped IPv6 addresses count as IPv4."""
    try:
        p, q = ipaddress.ip_address(peer.split("%", 1)[0]), ipaddress.ip_address(local.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(p, ipaddress.IPv6Address) and p.ipv4_mapped is not None:
        p = p.ipv4_mapped
    if isinstance(q, ipaddress.IPv6Address) and q.ipv4_mapped is not None:
        q = q.ipv4_mapped
    return p.is_loopback or p == q


def same_host(sock: socket.socket) -> bool:
    """A connected TCP socket whose peer is on this host (``same_host_addresses``)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        return same_host_addresses(sock.getpeername()[0], sock.getsockname()[0])
    except OSError:
        return False


def set_congestion(sock: socket.socket, name: str) -> bool:
    """Set the socket's TCP congestion control; False where the kernel refuses it (a name
    it does not have, or one not in net.ipv4.tcp_allowed_congestion_control for this user)."""
    if not name or not hasattr(socket, "TCP_CONGESTION"):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError:
        return False
    return True


def system_congestion() -> str:
    """The congestion control new TCP connections get here (net.ipv4.tcp_congestion_control);
    "" where that cannot be read (not Linux)."""
    try:
        with open(_SYSTEM_CONGESTION) as f:
            return f.read().strip()
    except OSError:
        return ""


def tune_same_host(sock: socket.socket, name: str = LOOPBACK_CONGESTION) -> bool:
    """``name`` as the congestion control of ``sock`` when it is a same-host TCP connection;
    True when it was set.  Connections to other hosts keep the system's."""
    return bool(name) and same_host(sock) and set_congestion(sock, name)
