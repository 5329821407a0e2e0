"""What a long-running QuillCache process shares with systemd and the operator: the log handler
on stderr and ``sd_notify`` (READY, RELOADING, STOPPING, STATUS).

Used by the node (``quillcache.node.daemon``) and the gateway (``quillcache.gateway.server``).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any, Mapping, Optional

__all__ = ["sd_notify", "setup_logging", "LOG_LEVELS"]

log = logging.getLogger("quillcache.service")

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR}


def sd_notify(message: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Send ``message`` (e.g. "READY=1") to $NOTIFY_SOCKET; False when unset or it failed.

    A unix datagram socket; a name starting with '@' is in the abstract namespace.
    """
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path[0] == "@":
        addr: Any = "\0" + path[1:]
    elif path[0] == "/":
        addr = path
    else:
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract name: not notifying", path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode("utf-8"))
    except OSError as exc:
        log.warning("sd_notify(%s) to %s failed: %s", message.split("\n")[0], path, exc)
        return False
    return True


class _StderrHandler(logging.StreamHandler):
    """The daemon's own log handler (added once however often setup_logging runs)."""


def setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(LOG_LEVELS[level])
