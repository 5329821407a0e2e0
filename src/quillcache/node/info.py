"""INFO / STATS of a node: its sections as ``key:value`` tables (``protocol.info`` renders them)."""
from __future__ import annotations

import os
import time
from typing import Any

from quillcache.protocol.opcodes import PROTOCOL_VERSION

__all__ = ["info_sections"]


def _flatten(prefix: str, d: dict, out: dict) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _flatten(f"{prefix}{k}_", v, out)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[f"{prefix}{k}"] = "" if v is None else v


def info_sections(node, conn=None) -> dict[str, dict[str, Any]]:
    """INFO's sections of ``node`` (a NodeServer), as seen by ``conn`` (its tenant) or the operator."""
    st = node.store.stats()
    server = {
        "node_id": node.node_id, "version": node.version, "protocol_version": PROTOCOL_VERSION,
        "process_id": os.getpid(), "uptime_s": round(time.time() - node.started, 3),
        "listen": node.listen, "unix_socket": node.unix_path, "shm": node.shm,
        "mapped_connections": sum(1 for c in node.connections if c.mapped),
        "located_leases": sum(c.located_leases for c in node.connections),
        "located_reserves": sum(c.located_reserves for c in node.connections),
        "mode": "open" if node.auth.open_mode else "auth",
        "connections": len(node.connections), "requests": node.requests,
        "requests_in_flight": node.in_flight, "protocol_errors": node.protocol_errors,
        "draining": node.draining, "received_bytes": node.request_counters.received_bytes,
        "sent_bytes": node.request_counters.sent_bytes,
        "sendfile_bytes": node.request_counters.sendfile_bytes,
        "loopback_congestion": node.loopback_congestion or "system",
        "loopback_congestion_set": node.loopback_congestion_set,
    }
    if node.auth.open_mode:
        server["mode_note"] = "open mode (no tenants configured)"
    store = dict(st.get("store", {}))
    tiers: dict[str, Any] = {}
    for tier in ("dram", "ssd"):
        if tier in st:
            _flatten(f"{tier}_", st[tier], tiers)
        else:
            tiers[f"{tier}_enabled"] = 0
    guard = dict(st.get("guard", {}))
    wal: dict[str, Any] = {"backend": node.wal_backend}
    if node.ssd is not None:
        try:
            _flatten("", node.ssd.stats(), wal)
        except Exception as exc:       # stats of a tier in trouble must not break INFO
            wal["stats_error"] = str(exc)
    auth = node.auth.stats()
    auth.update(node.admission.stats())
    auth["hello_timeout_s"] = node.hello_timeout
    auth["idle_timeout_s"] = node.idle_timeout
    auth["bad_input_log_suppressed"] = node.bad_input_log.suppressed_total
    auth["connection_tenant"] = (conn.tenant or "") if conn is not None else ""
    sections = {"Server": server, "Store": store, "Tiers": tiers, "Guard": guard, "WAL": wal, "Auth": auth}
    if node.router is not None:
        sections["Router"] = node.router.info()
    if node.cluster is not None:
        sections["Cluster"] = node.cluster.info()
    return sections
