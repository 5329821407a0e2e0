"""This node's record on an etcd lease, and its view of every node's record.

The record ``/quillcache/<cluster_id>/nodes/<node_id>`` (JSON: address, capacity, free,
epoch, version, started) sits on a lease of ``ttl`` seconds, kept alive every ``ttl/3``.
The epoch is a random nonce drawn at start and again whenever the lease was lost (the
node was cut off or stopped for longer than the TTL): homes drop a node's records when
its epoch changes, so an old epoch's records never name a copy that may be gone.

The etcd client is ``etcd3gw`` (the v3 JSON gateway over HTTP, synchronous).  All of it
runs in one thread of its own (plus one reading the watch stream), so etcd's latency or
absence never reaches the event loop: the loop only receives a new view, by
``call_soon_threadsafe``, when a record changes.  While etcd cannot be reached the last
view is kept, the state is ``degraded`` and the thread retries; when etcd answers again
the node keeps its lease if it is still alive, else registers with a new epoch, then
re-lists the prefix and watches from the listed revision.

A record is accepted into the view only when its node id is its etcd key's last part and,
with the pool's keys (``keys``, cluster/keys.py: always, in a node), when it carries
``sig``, the HMAC of its etcd key and content under the record key derived from the
credential, and names the lease etcd shows it on.  Anything else (a record an etcd writer
made up, one copied under another key, one claiming another node's id) is refused: counted
(``records_refused``), logged once per name and reason, and left out of the view.

A record is written only by a transaction, over nothing, over this process's own record,
or over the record of an earlier run of the same node (the same address: a node killed
without revoking its lease and started again takes its name back at once).  A node id that
another live process holds is not taken over: the state is ``conflict`` (logged as an
error, shown in INFO and metrics), this node stays out of the pool, serves on by itself
and tries again every ``ttl/3`` until that record goes.
"""
from __future__ import annotations

import base64
import json
import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import requests

log = logging.getLogger("quillcache.cluster")

__all__ = ["Member", "Membership", "node_prefix", "RECORD_REFRESH_S", "RecordRefused"]

RECORD_REFRESH_S = 10.0     # seconds between rewrites of this node's record (free space)
RETRY_S = 0.25              # seconds between attempts while etcd is unreachable


class Member(NamedTuple):
    node_id: str
    address: str            # host:port of the binary protocol
    epoch: int
    capacity: int
    free: int
    version: str
    started: float
    lease: int = 0          # the etcd lease under the record (another node may revoke it: a dead peer)

    @classmethod
    def from_json(cls, raw: bytes) -> "Member":
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, d: dict) -> "Member":
        return cls(str(d["node_id"]), str(d["address"]), int(d["epoch"]), int(d.get("capacity", 0)),
                   int(d.get("free", 0)), str(d.get("version", "")), float(d.get("started", 0.0)),
                   int(d.get("lease", 0)))

    def to_json(self) -> bytes:
        return json.dumps(self._asdict(), sort_keys=True).encode("utf-8")


def node_prefix(cluster_id: str) -> str:
    return f"/quillcache/{cluster_id}/nodes/"


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode("utf-8") if isinstance(s, str) else s).decode("ascii")


def _range_end(prefix: str) -> str:
    raw = bytearray(prefix.encode("utf-8"))
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode("ascii")


class EtcdUnavailable(Exception):
    pass


class RecordRefused(ValueError):
    """A record that is not a member's: unsigned, badly signed, or under another name."""


class NameTaken(Exception):
    """Another live process holds this node's record (a node id given to two nodes)."""


class _Gateway:
    """The few v3 gateway calls membership needs, each with a deadline, rotating over the
    endpoints when one fails."""

    def __init__(self, endpoints, timeout: float) -> None:
        import etcd3gw     # the [cluster] dependency; imported only by a clustered node
        self._etcd3gw = etcd3gw
        self.endpoints = [(h, p) for h, p in endpoints]
        self.timeout = timeout
        self._i = 0
        self._client = None

    def _connect(self):
        if self._client is None:
            host, port = self.endpoints[self._i % len(self.endpoints)]
            self._client = self._etcd3gw.Etcd3Client(host=host, port=port, timeout=self.timeout)
        return self._client

    def _rotate(self) -> None:
        self._i += 1
        if self._client is not None:
            try:
                self._client.session.close()
            except Exception:
                pass
        self._client = None

    def call(self, path: str, body: dict) -> dict:
        try:
            c = self._connect()
            return c.post(c.get_url(path), json=body)
        except Exception as exc:
            self._rotate()
            raise EtcdUnavailable(f"{path}: {exc}") from None

    def watch_stream(self, body: dict):
        c = self._connect()
        try:
            return c.session.post(c.get_url("/watch"), json=body, stream=True,
                                  timeout=(self.timeout, None))
        except Exception as exc:
            self._rotate()
            raise EtcdUnavailable(f"watch: {exc}") from None

    def close(self) -> None:
        self._rotate()


class Membership:
    """Register, keep alive, watch.  ``on_change(view, state)`` runs on ``loop``."""

    OWNER_FIELD = "address"     # the record's field naming where its process is (``address``)

    def __init__(self, *, endpoints, cluster_id: str, node_id: str, address: str, ttl: float,
                 version: str, space: Callable[[], tuple[int, int]], loop, on_change, keys=None) -> None:
        self.keys = keys                # cluster.keys.ClusterKeys: sign this record, check the others
        self.prefix = node_prefix(cluster_id)
        self.key = self.prefix + node_id
        self.node_id = node_id
        self.address = address
        self.ttl = float(ttl)
        self.version = version
        self._space = space
        self._loop = loop
        self._on_change = on_change
        self._gw = _Gateway(endpoints, timeout=max(0.2, self.ttl / 3))
        self.epoch = secrets.randbits(63)
        self.started = time.time()
        self.state = "starting"
        self.view: dict[str, Member] = {}
        self.registrations = 0
        self.epochs_started = 1
        self.degraded_events = 0
        self.view_changes = 0
        self.peers_revoked = 0
        self.conflicts = 0
        self.conflict = ""                      # why the name is refused, while state is "conflict"
        self.records_refused = 0                # records under the prefix that are not a member's
        self._refusals: dict[str, str] = {}     # name -> the reason last logged
        self._lease_id: Optional[int] = None
        self._record_written = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch_resp = None
        self._watch_thread: Optional[threading.Thread] = None
        self._thread: Optional[threading.Thread] = None
        self.registered = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qc-membership", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop keeping alive and revoke the lease (best effort): the others see this node
        leave at once instead of after the TTL."""
        self._stop.set()
        self._close_watch()
        if self._thread is not None:
            self._thread.join(timeout)
        lease = self._lease_id
        if lease is not None:
            try:
                self._gw.call("/kv/lease/revoke", {"ID": lease})
            except EtcdUnavailable:
                pass
        self._gw.close()
        self.state = "stopped"

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        wait = self.ttl / 3
        while not self._stop.is_set():
            try:
                if self._lease_id is None:
                    self._register()
                else:
                    res = self._gw.call("/lease/keepalive", {"ID": self._lease_id})
                    ttl = int(res.get("result", {}).get("TTL", -1))
                    if ttl <= 0:
                        log.warning("cluster: lease %x expired while this node was cut off: "
                                    "registering again with a new epoch", self._lease_id)
                        self._lease_id = None
                        self.epoch = secrets.randbits(63)
                        self.epochs_started += 1
                        continue
                    if time.monotonic() - self._record_written > RECORD_REFRESH_S:
                        self._put_record()
                if self._watch_thread is None or not self._watch_thread.is_alive():
                    self._relist_and_watch()
                if self.state != "ok":
                    if self.state == "degraded":
                        log.warning("cluster: etcd reachable again")
                    elif self.state == "conflict":
                        log.warning("cluster: the record of %s is free again: registered", self.node_id)
                        self.conflict = ""
                    self.state = "ok"
                    self._publish()
                self._stop.wait(wait)
            except NameTaken as exc:
                self._drop_lease()
                if self.state != "conflict":
                    self.conflicts += 1
                    self.conflict = str(exc)
                    log.error("cluster: %s; this node stays out of the pool (serving on by itself) and "
                              "tries again every %g s", exc, wait)
                    self.state = "conflict"
                    self._publish()
                if self._watch_thread is None or not self._watch_thread.is_alive():
                    try:
                        self._relist_and_watch()
                    except EtcdUnavailable:
                        pass
                self._stop.wait(wait)
            except EtcdUnavailable as exc:
                if self.state != "degraded":
                    self.degraded_events += 1
                    log.warning("cluster: etcd unreachable (%s): keeping the last view, serving on", exc)
                    self.state = "degraded"
                    self._publish()
                self._close_watch()
                self._stop.wait(RETRY_S)
            except Exception:
                log.exception("cluster: membership step failed")
                self._stop.wait(RETRY_S)

    def _record(self) -> Member:
        capacity, free = self._space()
        return Member(self.node_id, self.address, self.epoch, capacity, free, self.version, self.started,
                      self._lease_id or 0)

    def _register(self) -> None:
        res = self._gw.call("/lease/grant", {"TTL": max(1, round(self.ttl))})
        self._lease_id = int(res["ID"])
        try:
            self._put_record()
        except EtcdUnavailable:
            self._lease_id = None               # registered again from the start: this lease expires
            raise
        self.registrations += 1
        log.info("cluster: registered %s epoch %x (lease %x, ttl %gs)", self.node_id, self.epoch,
                 self._lease_id, self.ttl)
        self.registered.set()

    def _put_record(self) -> None:
        """Write this process's record on its lease, by a transaction: over its own record
        (the refresh), over nothing, or over an earlier run's record at the same address (that
        one is deleted first, its lease left to expire); raises NameTaken for another live
        process's record."""
        key = _b64(self.key)
        for _ in range(4):                     # each step that fails saw the record change
            if self._put_if({"key": key, "target": "LEASE", "result": "EQUAL", "lease": self._lease_id}) is None:
                return
            kv = self._put_if({"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": 0})
            if kv is None:
                return
            if not kv:
                continue                        # deleted between the compare and the read
            lease = int(kv.get("lease", 0))
            raw = base64.b64decode(kv.get("value", ""))
            if not self._earlier_run(raw):
                raise NameTaken(f"node id {self.node_id!r} is registered by another process "
                                f"({self._describe(raw)}, lease {lease:x})")
            self._gw.call("/kv/txn", {          # exactly that record: not one written meanwhile
                "compare": [{"key": key, "target": "LEASE", "result": "EQUAL", "lease": lease}],
                "success": [{"request_delete_range": {"key": key}}]})
            log.info("cluster: replaced the record of an earlier run of %s (lease %x)", self.node_id, lease)
        raise EtcdUnavailable(f"the record under {self.key} kept changing")

    def _put_if(self, compare: dict) -> Optional[dict]:
        """Put the record if ``compare`` holds: None when it was written, else the key-value
        now under the key ({} when there is none)."""
        key = compare["key"]
        res = self._gw.call("/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": key, "value": _b64(self._record_value()), "lease": self._lease_id}}],
            "failure": [{"request_range": {"key": key}}]})
        if res.get("succeeded"):
            self._record_written = time.monotonic()
            return None
        responses = res.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs") or []
        return kvs[0] if kvs else {}

    def _drop_lease(self) -> None:
        lease, self._lease_id = self._lease_id, None
        if lease is not None:
            try:
                self._gw.call("/kv/lease/revoke", {"ID": lease})
            except EtcdUnavailable:
                pass                            # it expires by itself

    def _earlier_run(self, raw: bytes) -> bool:
        """Whether ``raw``, the record under this process's key, was written by an earlier run
        of the same node: it names the same address (``OWNER_FIELD``) and a start before this
        one's, where it says (of two live processes claiming one address, the newer keeps it)."""
        try:
            d = json.loads(raw)
            if self.keys is not None and self._verified(self.key, d) is None:
                return True     # not a member's record (an etcd writer's): nobody to defer to
            return (bool(self.address) and d.get(self.OWNER_FIELD) == self.address
                    and float(d.get("started", 0.0)) <= self.started)
        except (ValueError, AttributeError, TypeError, UnicodeDecodeError):
            return False

    def _describe(self, raw: bytes) -> str:
        try:
            return f"{self.OWNER_FIELD} {json.loads(raw).get(self.OWNER_FIELD)!r}"
        except (ValueError, AttributeError, UnicodeDecodeError):
            return "a record that is not JSON"

    # The two hooks a subclass keeping other records under another prefix overrides
    # (cluster/engines.py: the engines a gateway routes to); a node's are its Member record.
    def _content(self) -> bytes:
        """This process's own record, a JSON object (``sig`` is added by ``_record_value``)."""
        return self._record().to_json()

    def _record_value(self) -> bytes:
        """The bytes of this process's own record (signed, with ``keys``)."""
        content = self._content()
        if self.keys is None:
            return content
        d = json.loads(content)
        content = json.dumps(d, sort_keys=True).encode("utf-8")     # the form a reader re-encodes
        d["sig"] = self.keys.sign_record(self.key, content)
        return json.dumps(d, sort_keys=True).encode("utf-8")

    def _verified(self, etcd_key: str, d: Any) -> Optional[dict]:
        """The record's fields without ``sig`` if ``sig`` signs them under ``etcd_key``, else None."""
        if not isinstance(d, dict):
            return None
        d = dict(d)
        sig = d.pop("sig", None)
        content = json.dumps(d, sort_keys=True).encode("utf-8")
        return d if self.keys.record_signed(etcd_key, content, sig) else None

    def _parse(self, name: str, raw: bytes, lease: int = 0) -> tuple[str, Any]:
        """(name in the view, value) of the record under ``prefix + name`` on etcd lease
        ``lease`` (its signature, with ``keys``, was checked and taken off); raises
        ValueError, KeyError or TypeError for a record that is not well formed, RecordRefused
        for one that is not a member's (either way it is skipped)."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        m = Member.from_dict(d)
        if m.node_id != name:
            raise RecordRefused(f"names node {m.node_id!r} under the key of {name!r}")
        if self.keys is not None and m.lease != lease:
            raise RecordRefused(f"signed for lease {m.lease:x}, stored on lease {lease:x}")
        return name, m

    def _accept(self, name: str, kv: dict) -> Optional[tuple[str, Any]]:
        """``_parse`` of an etcd key-value, or None (counted and logged) when it is refused."""
        try:
            raw = base64.b64decode(kv["value"])
            if self.keys is not None:
                d = self._verified(self.prefix + name, json.loads(raw))
                if d is None:
                    raise RecordRefused("not signed with this pool's record key")
                raw = json.dumps(d, sort_keys=True).encode("utf-8")
            return self._parse(name, raw, int(kv.get("lease", 0)))
        except RecordRefused as exc:
            self.records_refused += 1
            if self._refusals.get(name) != str(exc):
                self._refusals[name] = str(exc)
                log.warning("cluster: the record under %s%s is refused: %s", self.prefix, name, exc)
            return None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def _relist_and_watch(self) -> None:
        self._close_watch()
        res = self._gw.call("/kv/range", {"key": _b64(self.prefix), "range_end": _range_end(self.prefix)})
        view = {}
        for kv in res.get("kvs", []):
            try:
                key = base64.b64decode(kv["key"]).decode("utf-8", "replace")
            except (ValueError, KeyError, TypeError):
                continue
            got = self._accept(key[len(self.prefix):], kv)
            if got is not None:
                view[got[0]] = got[1]
        rev = int(res["header"]["revision"])
        with self._lock:
            self.view = view
        self._publish()
        resp = self._gw.watch_stream({"create_request": {
            "key": _b64(self.prefix), "range_end": _range_end(self.prefix), "start_revision": rev + 1}})
        self._watch_resp = resp
        t = threading.Thread(target=self._watch, args=(resp,), name="qc-watch", daemon=True)
        self._watch_thread = t
        t.start()

    def _close_watch(self) -> None:
        # Closing the response alone waits for the lock the reading thread holds until etcd
        # sends something, which an idle prefix may not do for a long time (a node's stop
        # then waited for the next record refresh): shut the socket down first, so that the
        # reader returns at once.
        resp, self._watch_resp = self._watch_resp, None
        if resp is None:
            return
        sock = getattr(getattr(getattr(resp, "raw", None), "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            resp.close()
        except Exception:
            pass

    def _watch(self, resp) -> None:
        dec = json.JSONDecoder()
        buf = ""
        try:
            for chunk in resp.iter_content(chunk_size=None):
                buf += chunk.decode("utf-8")
                while True:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    try:
                        msg, end = dec.raw_decode(buf)
                    except ValueError:
                        break                   # an incomplete message: wait for more
                    buf = buf[end:]
                    self._apply(msg.get("result", {}))
        except (requests.RequestException, OSError, ValueError, AttributeError):
            pass
        finally:
            resp.close()

    def _apply(self, result: dict) -> None:
        if result.get("canceled"):
            raise ValueError("watch canceled")
        events = result.get("events") or []
        if not events:
            return
        with self._lock:
            view = dict(self.view)
            for ev in events:
                kv = ev.get("kv", {})
                key = base64.b64decode(kv.get("key", "")).decode("utf-8", "replace")
                node = key[len(self.prefix):]
                if ev.get("type") == "DELETE":
                    view.pop(node, None)
                else:
                    got = self._accept(node, kv)
                    if got is None:
                        continue            # the last member record seen under it stays
                    view[got[0]] = got[1]
            self.view = view
        self._publish()

    def _publish(self) -> None:
        with self._lock:
            view = dict(self.view)
        state = self.state
        self.view_changes += 1
        try:
            self._loop.call_soon_threadsafe(self._on_change, view, state)
        except RuntimeError:
            pass                                # the loop is closed: the node is stopping

    def revoke_peer(self, lease: int) -> bool:
        """Revoke another node's lease (it was seen dead): its record goes now, not after
        the TTL.  Blocking (call it in an executor); False when etcd did not answer."""
        if not lease:
            return False
        try:
            self._gw.call("/kv/lease/revoke", {"ID": lease})
            self.peers_revoked += 1
            return True
        except EtcdUnavailable:
            return False

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, "epoch": f"{self.epoch:x}", "registrations": self.registrations,
                "epochs_started": self.epochs_started, "degraded_events": self.degraded_events,
                "view_changes": self.view_changes, "lease_ttl_s": self.ttl, "peers_revoked": self.peers_revoked,
                "conflicts": self.conflicts, "conflict": self.conflict, "records_refused": self.records_refused}
