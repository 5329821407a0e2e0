"""Engines on etcd: an engine's record on a lease, and a gateway's view of every engine's.

The record ``/quillcache/<cluster_id>/engines/<engine_id>`` is a JSON object with the keys
of a ``[[gateway.engines]]`` table (``id``, ``url``, ``model``, and optionally ``tokenizer``,
``tokenizer_id``, ``chat_template``, ``adapters``, ``role``, ``kv_events``, ``kv_replay``,
``block_size``); the gateway validates it exactly as it validates that table.  It sits on a
lease of ``ttl`` seconds that its registrant keeps alive, so an engine whose registrant dies
(or is cut off from etcd for longer than the TTL) leaves every gateway's view by itself.

Both sides are ``Membership`` (cluster/membership.py) with another prefix and another record:
the same etcd client, the same lease, keep-alive and watch thread, the same behaviour while
etcd is unreachable (the last view is kept, the state is ``degraded``, the thread retries).

``EngineRegistration``  keeps one engine's record (``quillcache-sim-engine --etcd``,
                        ``quillctl engine register``); it watches nothing.
``EngineWatch``         lists and watches the prefix, registers nothing (the gateway).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

from quillcache.cluster.membership import Membership

__all__ = ["engine_prefix", "EngineRegistration", "EngineWatch", "MAX_RECORD_BYTES"]

MAX_RECORD_BYTES = 64 << 10          # bytes of one engine record at most (a few hundred in practice)
WATCH_TIMEOUT_S = 3.0                # etcd deadline scale of a watcher: calls time out after 1 s


def engine_prefix(cluster_id: str) -> str:
    return f"/quillcache/{cluster_id}/engines/"


def _no_space() -> tuple[int, int]:
    return 0, 0


class EngineRegistration(Membership):
    """Keep ``record`` (a ``[[gateway.engines]]`` table as a dict) under the cluster's engine
    prefix on a lease of ``ttl`` seconds until ``stop()``, which revokes it (the gateways drop
    the engine at once).  Runs on its own thread; needs no event loop."""

    def __init__(self, *, endpoints, cluster_id: str, record: dict, ttl: float, version: str = "") -> None:
        raw = json.dumps(record, sort_keys=True).encode("utf-8")
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"engine record of {len(raw)} bytes (at most {MAX_RECORD_BYTES})")
        super().__init__(endpoints=endpoints, cluster_id=cluster_id, node_id=str(record["id"]),
                         address=str(record.get("url", "")), ttl=ttl, version=version,
                         space=_no_space, loop=None, on_change=None)
        self.prefix = engine_prefix(cluster_id)
        self.key = self.prefix + self.node_id
        self._raw = raw

    def _record_value(self) -> bytes:
        return self._raw

    def _relist_and_watch(self) -> None:
        pass                                # a registrant does not need the others' records

    def _publish(self) -> None:
        pass                                # nobody listens: ``state`` is read directly


class EngineWatch(Membership):
    """List and watch the cluster's engine records; ``on_change(view, state)`` runs on
    ``loop`` with ``view`` = {engine id: the record's JSON object}."""

    def __init__(self, *, endpoints, cluster_id: str, loop,
                 on_change: Callable[[dict[str, Any], str], None]) -> None:
        super().__init__(endpoints=endpoints, cluster_id=cluster_id, node_id="", address="",
                         ttl=WATCH_TIMEOUT_S, version="", space=_no_space, loop=loop, on_change=on_change)
        self.prefix = engine_prefix(cluster_id)
        self.key = ""

    def _register(self) -> None:
        self.registered.set()               # a watcher keeps no record of its own

    def _parse(self, name: str, raw: bytes) -> tuple[str, Any]:
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"record of {len(raw)} bytes")
        return name, _record_of(raw)


def _record_of(raw: bytes) -> Optional[dict]:
    """The record's JSON object, or None when it is not one (the gateway reports it)."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None
