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

With ``keys`` (the pool's ``cluster.keys.ClusterKeys``, from the ``[cluster] credential``) a
registration signs its record as a node signs its own (docs/security.md) and a watch refuses
every record that is not so signed or whose ``id`` is not its key's name: an etcd writer
cannot then point a gateway at an engine of its own.  The gateway (``[cluster] credential``)
and both registrants (``--credential-file`` or QUILLCACHE_CLUSTER_CREDENTIAL) always pass
``keys``; without them records are neither signed nor checked (library use only).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

from quillcache.cluster.membership import Membership, RecordRefused

__all__ = ["engine_prefix", "EngineRegistration", "EngineWatch", "MAX_RECORD_BYTES", "cluster_args",
           "advertised", "keep_registered", "HEALTH_FAILURES", "etcd_client_missing"]

MAX_RECORD_BYTES = 64 << 10          # bytes of one engine record at most (a few hundred in practice)
WATCH_TIMEOUT_S = 3.0                # etcd deadline scale of a watcher: calls time out after 1 s


def engine_prefix(cluster_id: str) -> str:
    return f"/quillcache/{cluster_id}/engines/"


def etcd_client_missing() -> Optional[str]:
    """Why this process cannot talk to etcd (the [cluster] extra is not installed), or None."""
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "the etcd client is not installed: pip install 'quillcache[cluster]' (etcd3gw)"
    return None


def cluster_args(etcd: Sequence[str], cluster_id: str, ttl: Any) -> tuple[tuple, str, float]:
    """A registrant's --etcd, --cluster-id and --lease-ttl, converted by the node's own
    [cluster] settings (one meaning for etcd, cluster_id and lease_ttl); raises
    ConversionError naming the option."""
    from quillcache.cluster.settings import CLUSTER_BY_NAME as cluster
    from quillcache.net import ConversionError
    out = []
    for option, name, value in (("--etcd", "etcd", list(etcd)), ("--cluster-id", "cluster_id", cluster_id),
                                ("--lease-ttl", "lease_ttl", ttl)):
        try:
            out.append(cluster[name].convert(value))
        except ConversionError as exc:
            raise ConversionError(f"{option} {value!r}: {exc}") from None
    return out[0], out[1], out[2]


def advertised(address: str, host: str) -> str:
    """``address`` (an http:// URL or a tcp:// ZMQ endpoint) with its host replaced by
    ``host`` (the one other machines reach this engine at); unchanged when ``host`` is empty."""
    if not host or not address:
        return address
    parts = urlsplit(address)
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _no_space() -> tuple[int, int]:
    return 0, 0


class EngineRegistration(Membership):
    """Keep ``record`` (a ``[[gateway.engines]]`` table as a dict) under the cluster's engine
    prefix on a lease of ``ttl`` seconds until ``stop()``, which revokes it (the gateways drop
    the engine at once).  Runs on its own thread; needs no event loop."""

    OWNER_FIELD = "url"         # an engine record names its process by url (``address`` here)

    def __init__(self, *, endpoints, cluster_id: str, record: dict, ttl: float, version: str = "",
                 keys=None) -> None:
        raw = json.dumps(record, sort_keys=True).encode("utf-8")
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"engine record of {len(raw)} bytes (at most {MAX_RECORD_BYTES})")
        super().__init__(endpoints=endpoints, cluster_id=cluster_id, node_id=str(record["id"]),
                         address=str(record.get("url", "")), ttl=ttl, version=version,
                         space=_no_space, loop=None, on_change=None, keys=keys)
        self.prefix = engine_prefix(cluster_id)
        self.key = self.prefix + self.node_id
        self._raw = raw

    def _content(self) -> bytes:
        return self._raw

    def _relist_and_watch(self) -> None:
        pass                                # a registrant does not need the others' records

    def _publish(self) -> None:
        pass                                # nobody listens: ``state`` is read directly


class EngineWatch(Membership):
    """List and watch the cluster's engine records; ``on_change(view, state)`` runs on
    ``loop`` with ``view`` = {engine id: the record's JSON object}."""

    def __init__(self, *, endpoints, cluster_id: str, loop,
                 on_change: Callable[[dict[str, Any], str], None], keys=None) -> None:
        super().__init__(endpoints=endpoints, cluster_id=cluster_id, node_id="", address="",
                         ttl=WATCH_TIMEOUT_S, version="", space=_no_space, loop=loop, on_change=on_change,
                         keys=keys)
        self.prefix = engine_prefix(cluster_id)
        self.key = ""

    def _register(self) -> None:
        self.registered.set()               # a watcher keeps no record of its own

    def _parse(self, name: str, raw: bytes, lease: int = 0) -> tuple[str, Any]:
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"record of {len(raw)} bytes")
        record = _record_of(raw)
        if self.keys is not None and (record is None or str(record.get("id")) != name):
            raise RecordRefused(f"names engine {record and record.get('id')!r} under the key of {name!r}")
        return name, record


def _record_of(raw: bytes) -> Optional[dict]:
    """The record's JSON object, or None when it is not one (the gateway reports it)."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


HEALTH_FAILURES = 2                  # consecutive failed health checks before the record is withdrawn


def _healthy(url: str, timeout: float) -> tuple[bool, str]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200, f"HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))


def keep_registered(*, endpoints, cluster_id: str, record: dict, ttl: float, health_interval: float,
                    stop, report: Callable[[str], None], version: str = "", keys=None) -> None:
    """Keep ``record`` registered until ``stop`` (a threading.Event) is set, then withdraw it.

    With ``health_interval`` > 0 the record is there only while ``<url>/health`` answers 200:
    it is registered once the engine is up, withdrawn after HEALTH_FAILURES failed checks in a
    row (the gateways stop routing to it) and registered again when it answers.  ``report``
    gets one line per change (registered, withdrawn, etcd unreachable or back)."""
    health_url = str(record["url"]).rstrip("/") + "/health"
    reg: Optional[EngineRegistration] = None
    failures = 0
    etcd_state = ""
    try:
        while not stop.is_set():
            ok, why = _healthy(health_url, min(health_interval, 5.0)) if health_interval > 0 else (True, "")
            failures = 0 if ok else failures + 1
            if ok and reg is None:
                reg = EngineRegistration(endpoints=endpoints, cluster_id=cluster_id, record=record, ttl=ttl,
                                         version=version, keys=keys)
                reg.start()
                report(f"registering {record['id']} ({record['url']}) under {reg.key}, lease TTL {ttl:g}s")
            elif reg is not None and failures >= HEALTH_FAILURES:
                reg.stop()
                reg = None
                etcd_state = ""
                report(f"withdrawn: {health_url} failed {failures} times ({why})")
            if reg is not None and reg.state in ("ok", "degraded", "conflict") and reg.state != etcd_state:
                etcd_state = reg.state
                report({"ok": "registered",
                        "degraded": "etcd unreachable: retrying (the record goes when its lease expires)",
                        "conflict": f"not registered: {reg.conflict}; retrying"}[etcd_state])
            stop.wait(health_interval if health_interval > 0 else ttl / 3)
    finally:
        if reg is not None:
            reg.stop()                       # revokes the lease: the gateways drop it at once
            report(f"withdrawn {record['id']}")
