"""``ClusterHook``: the one object through which the node server takes part in a pool.

The server calls it in four places and nowhere else:

* a HELLO whose token is ``NODE_HELLO_TOKEN`` (a marker, no secret) admits a connection
  that then logs in as a node with NODE_AUTH and NODE_PROOF (challenge and response on a
  key derived from the credential, both ways: docs/security.md); the connection is then a
  member connection, bound to the node id and epoch it proved, and may use the node
  opcodes only, never the tenant API;
* a GET, GET_MANY or located GET that misses locally is handed to ``serve_get``,
  ``serve_get_many`` or ``serve_located`` (cluster/reads.py: locate at the key's home,
  fetch from a holder, check, serve; a miss otherwise);
* a client PUT that landed is handed to ``after_put`` (replicas, hashed placement);
* opcodes 0x40-0x4B go to ``on_request`` (NIXL_META, GRANT, GRANT_RELEASE on to the
  ``GrantTable`` of cluster/grants.py where the node reads and serves with NIXL).

The store tells it what it holds (``set_residency_listener``): every block that appears
is announced to its home, every block that goes is withdrawn, in batches sent by one
flusher task a few milliseconds later (the put path has no network hop).  A view change
from ``Membership`` re-homes keys: homes drop the records of nodes that left or changed
epoch, and holders re-announce the keys whose home moved, at ``reannounce_rate`` keys/s.

A member connection may ANNOUNCE and WITHDRAW only records of the node id and epoch it
logged in with.  Each announced record carries the CRC32C of the block as this node stored
it (computed by the flusher from the store's bytes, off the put path; a PUT over a key
already held computes it again): the home keeps it with the record, LOCATE returns it, and
a reader drops fetched bytes that do not match it (cluster/reads.py).

Faults cost misses: every hop has a deadline (``hop_timeout``); a holder that is gone,
stale or answers wrongly is skipped for the next one; none left is a miss.  The bytes a
fetch returns come from the holder's store after its identity guard, and must have the
size and the CRC32C the record says.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
import socket
import time
import weakref
from typing import Any, NamedTuple, Optional, Sequence

from quillcache.protocol import cluster as wire, messages
from quillcache._native.crc import crc32c
from quillcache.cluster.grants import GRANT_OPCODES, serve as serve_grants
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.cluster.keys import ClusterKeys
from quillcache.cluster.membership import Member, Membership
from quillcache.cluster.reads import MAX_HOLDER_TRIES, PoolReads
from quillcache.cluster.records import ArtRecordStore, Holder
from quillcache.errors import (
    Busy, InvalidArgument, NotFound, PermissionDenied, QuillCacheError, UnsafeReuse,
)
from quillcache.model import KvBlockKey, decode_key, encode_key
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, Opcode, ProtocolLimits
from quillcache.store.leases import release_leases as _release
from quillcache.transfer.base import Peer
from quillcache.transfer.tcp import TcpTransport

log = logging.getLogger("quillcache.cluster")

__all__ = ["ClusterHook", "FLUSH_S", "MAX_HOLDER_TRIES"]

FLUSH_S = 0.002             # seconds: how long announcements gather before they are sent
RETRY_HOME_S = 0.2          # seconds before a home that failed is tried again
MAX_PUSHES = 8              # replica pushes in flight
REANNOUNCE_CHUNK = 512      # keys per step of a re-announcement round
DEATH_PROBES = 3            # refused connects, PROBE_GAP_S apart, that make a closed peer dead
PROBE_GAP_S = 0.05          # seconds
CRC_INLINE_BYTES = 1 << 20  # blocks up to this are checksummed on the loop, bigger ones in a thread

_PEER_OPS = frozenset({Opcode.ANNOUNCE, Opcode.WITHDRAW, Opcode.LOCATE, Opcode.FETCH, Opcode.REPLICATE,
                       *GRANT_OPCODES})
_MISS = (NotFound, UnsafeReuse, Busy)


class _Login(NamedTuple):
    """A node login between NODE_AUTH and NODE_PROOF: the transcript both MACs cover."""
    initiator: str
    epoch: int
    responder: str
    responder_epoch: int
    nonce_i: bytes
    nonce_r: bytes


class ClusterHook(PoolReads):
    def __init__(self, settings, *, store, node_id: str, address: str, limits: ProtocolLimits,
                 version: str = "", auth=None, transport=None) -> None:
        self.settings = settings
        self.store = store
        self.node_id = node_id
        self.address = address
        self.limits = limits
        self.version = version
        self.auth = auth                # the node's Authenticator (reloaded in place); None: open
        # The credential stays here: only keys derived from it are used (cluster/keys.py).
        self.keys = ClusterKeys(settings.credential, settings.cluster_id) if settings.credential else None
        self.hop_timeout = float(settings.hop_timeout)
        self.replicas = int(settings.replicas)
        self.placement = settings.placement
        self.cache_remote = bool(settings.cache_remote)
        self.reannounce_rate = int(settings.reannounce_rate)
        self.transport = transport or TcpTransport(self.keys, node_id=node_id, epoch=lambda: self.epoch,
                                                   limits=limits, max_fetch_bytes=limits.max_payload_bytes)
        # The CRC32C of each held block as this node stored it (announced with its record);
        # absent until the flusher computed it, and dropped when the block changes or goes.
        self.crcs: dict[bytes, int] = {}
        self._crc_pending: dict[bytes, object] = {}      # key -> token of a computation in flight
        self._logins: "weakref.WeakKeyDictionary[Any, _Login]" = weakref.WeakKeyDictionary()
        self.records = ArtRecordStore(store.index, store.holder, lambda: (self.node_id, self.epoch),
                                      self.crcs.get)
        self.view: dict[str, Member] = {}
        self.state = "starting"
        self.ring = Ring([node_id])
        self.membership: Optional[Membership] = None
        # What this node holds: encoded key -> size, None for a block recovered at start and
        # not touched since (its size is asked of the store when it is announced).
        self.held: dict[bytes, Optional[int]] = {}
        self.announced: dict[bytes, tuple[str, int]] = {}        # key -> (home, home epoch) told
        self._ann: dict[str, dict[bytes, int]] = {}              # home -> keys to announce
        self._wd: dict[str, set[bytes]] = {}                     # home -> keys to withdraw
        self._retry_at: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._reannounce = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self._push_slots = asyncio.Semaphore(MAX_PUSHES)
        self._epoch_announced: Optional[int] = None
        self.detected: dict[str, float] = {}                     # node -> time.time() it left the view
        self.counters = dict.fromkeys((
            "remote_hits", "remote_misses", "locates_sent", "locate_failures", "fetches_sent",
            "fetch_failures", "stale_hops", "announced", "withdrawn", "announce_failures",
            "records_dropped", "replicas_pushed", "replica_failures", "cached_remote",
            "reannounce_rounds", "reannounce_scanned", "reannounce_queued", "fetches_served",
            "locates_served", "location_cache_hits", "peers_seen_dead", "located_remote",
            "located_not_stored", "crc_mismatches", "logins", "logins_refused", "records_refused_sender",
            "replicas_fetched"), 0)
        self.reannounce_total = 0
        self.reannounce_active = False
        self._unseen: dict[tuple[str, int], float] = {}   # (node, epoch) announced before seen -> when
        self._unseen_grace = 2.0 * float(settings.lease_ttl)
        self._reads_init()
        self._sentinels: dict[str, tuple[int, asyncio.Task]] = {}   # node -> (epoch, its watch task)
        self.grants = None              # GrantTable: the NIXL transport's holder side (cluster/grants.py)

    # ------------------------------------------------------------------ lifecycle

    @property
    def epoch(self) -> int:
        return self.membership.epoch if self.membership is not None else 0

    def _space(self) -> tuple[int, int]:
        st = self.store.stats()["dram"]
        return int(st["capacity"]), int(st["capacity"]) - int(st["used"])

    async def start(self, *, membership: bool = True) -> None:
        loop = asyncio.get_running_loop()
        s = self.settings
        if membership:
            self.membership = Membership(
                endpoints=s.etcd, cluster_id=s.cluster_id, node_id=self.node_id, address=self.address,
                ttl=s.lease_ttl, version=self.version, space=self._space, loop=loop,
                on_change=self._on_view, keys=self.keys)
            self.membership.start()
        # What the store holds now is announced by the re-announcer, at reannounce_rate keys
        # a second, not here: a node restarting with millions of blocks serves at once.
        self.held = self.store.set_residency_listener(self._added, self._dropped)
        self._reannounce.set()
        self._tasks = [loop.create_task(self._flusher(), name="qc-cluster-flush"),
                       loop.create_task(self._reannouncer(), name="qc-cluster-reannounce")]
        if self.membership is not None:
            # Serve at once either way; wait (bounded) only so a node that can reach etcd
            # starts with a view.
            await loop.run_in_executor(None, self.membership.registered.wait, s.lease_ttl)

    async def stop(self) -> None:
        for _, t in self._sentinels.values():
            t.cancel()
        self._sentinels.clear()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.store.set_residency_listener(None, None)
        if self.membership is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.membership.stop)
        if self.grants is not None:
            self.grants.close()
        await self.transport.close()

    def is_node_hello(self, token: bytes) -> bool:
        """Whether a HELLO announces a node about to log in (NODE_AUTH, NODE_PROOF): the
        connection is admitted with no tenant and can do nothing else until it proves the key."""
        return self.keys is not None and bytes(token) == wire.NODE_HELLO_TOKEN

    # ------------------------------------------------------------------ the view

    def _on_view(self, view: dict[str, Member], state: str) -> None:
        now = time.time()
        old = self.view
        self.state = state
        self.view = view
        for node, m in old.items():
            cur = view.get(node)
            if cur is None or cur.epoch != m.epoch:
                self.transport.forget(node)
                if cur is None:
                    self.detected[node] = now
        # Records of a (node, epoch) the view does not show go, unless they came in before
        # this node saw that epoch join (an ANNOUNCE may overtake the watch): those stay for
        # a grace period.  A LOCATE names only holders live in the view either way.
        mono = time.monotonic()
        for node in self.records.nodes():
            live = view.get(node)
            for epoch in self.records.epochs(node):
                if live is not None and live.epoch == epoch:
                    self._unseen.pop((node, epoch), None)
                elif mono - self._unseen.get((node, epoch), -math.inf) > self._unseen_grace:
                    self._unseen.pop((node, epoch), None)
                    self.counters["records_dropped"] += self.records.drop_epoch(node, epoch)
        for seen_late, since in list(self._unseen.items()):
            if mono - since > self._unseen_grace:
                del self._unseen[seen_late]         # its records were withdrawn meanwhile
        self._watch_peers()
        ring = Ring(set(view) | {self.node_id})
        changed = ring != self.ring or any(
            old.get(n) is None or old[n].epoch != m.epoch for n, m in view.items())
        self.ring = ring
        if changed or self._epoch_announced != self.epoch:
            self._reannounce.set()

    # A process that dies (kill -9, a crash) has its sockets closed by the kernel: a
    # connection held open to every peer sees EOF at once.  If the peer's port then refuses
    # DEATH_PROBES connects in a row, nothing listens there any more: its lease is revoked,
    # and every node drops it from its view in milliseconds instead of after the TTL.  A
    # stopped or cut-off node keeps its sockets (no EOF): the lease TTL covers those.

    def _watch_peers(self) -> None:
        for node, (epoch, task) in list(self._sentinels.items()):
            m = self.view.get(node)
            if m is None or m.epoch != epoch:
                task.cancel()
                del self._sentinels[node]
        if self.membership is None:
            return
        loop = asyncio.get_running_loop()
        for node, m in self.view.items():
            if node != self.node_id and node not in self._sentinels and m.lease:
                self._sentinels[node] = (m.epoch, loop.create_task(self._sentinel(m), name=f"qc-sentinel-{node}"))

    async def _sentinel(self, m: Member) -> None:
        host, _, port = m.address.rpartition(":")
        host = host.strip("[]")
        try:
            while True:
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                                            self.hop_timeout)
                except (OSError, asyncio.TimeoutError):
                    await asyncio.sleep(self.hop_timeout)
                    continue
                try:
                    while await reader.read(4096):
                        pass                # nothing is sent on it; anything read is ignored
                except OSError:
                    pass
                finally:
                    writer.close()
                refused = 0
                for _ in range(DEATH_PROBES):
                    await asyncio.sleep(PROBE_GAP_S)
                    try:
                        _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.hop_timeout)
                        w.close()
                        break
                    except ConnectionRefusedError:
                        refused += 1
                    except (OSError, asyncio.TimeoutError):
                        break
                if refused == DEATH_PROBES:
                    log.warning("cluster: %s (epoch %x) closed its connections and refuses new ones: "
                                "revoking its lease", m.node_id, m.epoch)
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(None, self.membership.revoke_peer, m.lease)
                    self.counters["peers_seen_dead"] += 1
                    return
        except asyncio.CancelledError:
            raise

    def peer(self, node_id: str) -> Optional[Peer]:
        m = self.view.get(node_id)
        return None if m is None else Peer(node_id, m.address, m.epoch)

    def home_of(self, ekey: bytes) -> str:
        return self.ring.home(key_hash(ekey))

    # ------------------------------------------------------------------ what this node holds

    def _added(self, ekey: bytes, size: int) -> None:
        self.held[ekey] = size
        self._announce(ekey, size)

    def _announce(self, ekey: bytes, size: Optional[int]) -> None:
        if size is None:                        # recovered at start: the store knows its size
            size = self.store.resident_size(ekey)
            if size is None:
                self.held.pop(ekey, None)       # not resident any more (defensive: drops are told)
                return
            self.held[ekey] = size
            # and the CRC its SSD tier recorded when the block was written (the block stays
            # untouched: nothing is read or decoded to announce it)
            crc = self.store.stored_crc(ekey)
            if crc is not None and ekey not in self._crc_pending:
                self.crcs[ekey] = crc
        home = self.home_of(ekey)
        if home == self.node_id:                # the store's own record is the home's record:
            self.announced[ekey] = (home, self.epoch)   # the flusher only computes its CRC
        else:
            m = self.view.get(home)
            self.announced[ekey] = (home, m.epoch if m is not None else 0)
        self._ann.setdefault(home, {})[ekey] = size
        wd = self._wd.get(home)
        if wd:
            wd.discard(ekey)
        self._wake.set()

    def _changed(self, ekey: bytes) -> None:
        """The bytes under ``ekey`` changed or went: its CRC is computed again when needed."""
        self.crcs.pop(ekey, None)
        self._crc_pending.pop(ekey, None)

    def _dropped(self, ekey: bytes) -> None:
        self.held.pop(ekey, None)
        self._changed(ekey)
        told = self.announced.pop(ekey, None)
        if told is None:
            return
        home = told[0]
        ann = self._ann.get(home)
        if ann is not None and ekey in ann:
            del ann[ekey]               # never sent: nothing to take back
            return
        if home == self.node_id:
            return                      # the store dropped its own record
        self._wd.setdefault(home, set()).add(ekey)
        self._wake.set()

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(FLUSH_S)
            now = time.monotonic()
            sends = []
            for home in set(self._ann) | set(self._wd):
                if self._retry_at.get(home, 0.0) > now:
                    continue
                if home == self.node_id:        # blocks homed here: their CRCs, for LOCATE
                    sends.append(self._crcs_of(list(self._ann.pop(home, {}))))
                    self._wd.pop(home, None)
                    continue
                peer = self.peer(home)
                ann = self._ann.pop(home, {})
                wd = self._wd.pop(home, set())
                if peer is None or self.ring.nodes and home not in self.ring.nodes:
                    continue            # the home left: re-announcement re-homes these keys
                if ann or wd:
                    sends.append(self._send_records(peer, ann, wd))
            if sends:
                await asyncio.gather(*sends)
            if self._ann or self._wd:
                self._wake.set()
                await asyncio.sleep(RETRY_HOME_S / 4)

    async def _send_records(self, peer: Peer, ann: dict[bytes, int], wd: set[bytes]) -> None:
        deadline = time.monotonic() + self.hop_timeout
        batch = self.limits.max_batch
        epoch = self.epoch
        try:
            keys = list(ann)
            crcs = await self._crcs_of(keys)
            items = [(k, ann[k], crc) for k, crc in zip(keys, crcs) if crc is not None]
            for i in range(0, len(items), batch):
                body = wire.encode_announce(self.node_id, epoch, items[i:i + batch], self.limits)
                await self.transport.request(peer, Opcode.ANNOUNCE, body, deadline)
                self.counters["announced"] += len(items[i:i + batch])
            keys = list(wd)
            for i in range(0, len(keys), batch):
                body = wire.encode_withdraw(self.node_id, epoch, keys[i:i + batch], self.limits)
                await self.transport.request(peer, Opcode.WITHDRAW, body, deadline)
                self.counters["withdrawn"] += len(keys[i:i + batch])
        except QuillCacheError as exc:
            self.counters["announce_failures"] += 1
            log.debug("records to %s failed (%s): retrying", peer.node_id, exc)
            self._retry_at[peer.node_id] = time.monotonic() + RETRY_HOME_S
            pending = self._ann.setdefault(peer.node_id, {})
            for k, size in ann.items():
                if k in self.held:
                    pending.setdefault(k, size)
            self._wd.setdefault(peer.node_id, set()).update(wd)

    async def _crcs_of(self, ekeys: Sequence[bytes]) -> list[Optional[int]]:
        """The CRC32C of each held block as stored here (None: not resident any more)."""
        return [await self._crc_of(ek) for ek in ekeys]

    async def _crc_of(self, ekey: bytes) -> Optional[int]:
        crc = self.crcs.get(ekey)
        if crc is not None:
            return crc
        token = object()
        self._crc_pending[ekey] = token
        try:
            key = decode_key(ekey)
            lease = self.store.get_nowait(key)
            if lease is None:
                lease = await self.store.get_async(key)     # SSD: read off the loop
        except (QuillCacheError, ValueError):
            self._crc_pending.pop(ekey, None)
            return None
        try:
            view = lease.view
            if view.nbytes <= CRC_INLINE_BYTES:
                crc = crc32c(view)
            else:
                crc = await asyncio.get_running_loop().run_in_executor(None, crc32c, view)
        finally:
            lease.release()
        # The bytes may have changed meanwhile (``_changed`` took the token): this CRC is
        # still what the lease held, good for this announcement, but not kept.
        if self._crc_pending.get(ekey) is token:
            del self._crc_pending[ekey]
            if ekey in self.held:
                self.crcs[ekey] = crc
        return crc

    async def _reannouncer(self) -> None:
        """After a view change: every held key whose home (or the home's epoch) is not the
        one last told is announced again, ``reannounce_rate`` keys per second."""
        while True:
            await self._reannounce.wait()
            self._reannounce.clear()
            self.reannounce_active = True
            self.counters["reannounce_rounds"] += 1
            epoch = self.epoch
            if self._epoch_announced != epoch:
                self.announced.clear()          # a new epoch: every home forgot the old one
                self._epoch_announced = epoch
            keys = list(self.held)
            self.reannounce_total = len(keys)
            scanned = 0
            t0 = time.monotonic()
            for i in range(0, len(keys), REANNOUNCE_CHUNK):
                if self._reannounce.is_set():
                    break                       # the view changed again: start over
                for ekey in keys[i:i + REANNOUNCE_CHUNK]:
                    if ekey not in self.held:
                        continue
                    home = self.home_of(ekey)
                    m = self.view.get(home)
                    target = (home, m.epoch if m is not None else 0)
                    if home == self.node_id:
                        target = (home, epoch)
                    if self.announced.get(ekey) != target:
                        self._announce(ekey, self.held[ekey])
                        self.counters["reannounce_queued"] += 1
                scanned += len(keys[i:i + REANNOUNCE_CHUNK])
                self.counters["reannounce_scanned"] += len(keys[i:i + REANNOUNCE_CHUNK])
                ahead = scanned / self.reannounce_rate - (time.monotonic() - t0)
                await asyncio.sleep(max(ahead, 0.0))
            self.reannounce_active = False

    # ------------------------------------------------------------------ after a client put

    def after_put(self, keys: Sequence[KvBlockKey]) -> None:
        """A client PUT landed: a key held before has new bytes (a new key was told by the
        store's listener): its CRC is computed again and its record announced again; then
        the replicas (REPLICATE: each fetches the block from here)."""
        for key in keys:
            ekey = encode_key(key)
            if ekey in self.crcs or ekey in self._crc_pending:
                self._changed(ekey)
                self._announce(ekey, self.held.get(ekey))
        if self.replicas <= 1 and self.placement == "local":
            return
        by_node: dict[str, list[bytes]] = {}
        for key in keys:
            ekey = encode_key(key)
            order = [n for n in self.ring.order(key_hash(ekey)) if n != self.node_id]
            if self.placement == "hashed":
                first = self.ring.order(key_hash(ekey), self.replicas)
                targets = [n for n in first if n != self.node_id]
            else:
                targets = order[:self.replicas - 1]
            for node in targets:
                by_node.setdefault(node, []).append(ekey)
        for node, ekeys in by_node.items():
            peer = self.peer(node)
            if peer is not None:
                self.background(self._replicate(peer, ekeys))

    async def _replicate(self, peer: Peer, ekeys: list[bytes]) -> None:
        async with self._push_slots:
            items = []
            for ek, crc in zip(ekeys, await self._crcs_of(ekeys)):
                size = self.held.get(ek)
                if crc is not None and size is not None:
                    items.append((ek, size, crc))
            if not items:
                return                  # gone already
            body = wire.encode_replicate(items, self.limits)
            for attempt in range(2):        # one more try: the notice is small, a lost one loses a copy
                try:
                    await self.transport.request(peer, Opcode.REPLICATE, body, time.monotonic() + self.hop_timeout)
                    self.counters["replicas_pushed"] += len(items)
                    return
                except QuillCacheError as exc:
                    if attempt == 0:
                        await asyncio.sleep(RETRY_HOME_S)
                        continue
                    self.counters["replica_failures"] += 1
                    log.debug("replica of %d blocks to %s failed: %s", len(items), peer.node_id, exc)

    async def _take_replicas(self, holder: str, epoch: int, items: list) -> None:
        """REPLICATE from ``holder``: fetch the blocks not held here from it, check them
        against the CRCs it recorded, keep them (the store's listener announces them)."""
        todo = [(decode_key(ek), ek, size, crc) for ek, size, crc in items]
        todo = [t for t in todo if not self.store.exists(t[0])]
        by_tenant: dict[str, list[int]] = {}
        for i, t in enumerate(todo):
            by_tenant.setdefault(t[0].tenant_id, []).append(i)
        deadline = time.monotonic() + self.hop_timeout
        for tenant, idx in by_tenant.items():
            ekeys = [todo[i][1] for i in idx]
            got: list[Optional[memoryview]] = [None] * len(idx)
            records = [Holder(holder, epoch, todo[i][2], todo[i][3]) for i in idx]
            await self._fetch_from(records, range(len(idx)), tenant, ekeys, got, deadline)
            for j, i in enumerate(idx):
                if got[j] is None:
                    self.counters["replica_failures"] += 1
                    continue
                try:
                    await self.store.put(todo[i][0], got[j])
                    self.counters["replicas_fetched"] += 1
                except QuillCacheError:
                    self.counters["replica_failures"] += 1          # no room: no replica here

    # ------------------------------------------------------------------ requests from peers

    def on_request(self, conn, frame) -> None:
        """Opcodes 0x40-0x4B.  The server's tenant check does not run for the node opcodes
        (``wire.NODE_OPCODES``): they are decided here, by the connection's node login."""
        op = frame.opcode
        rid = frame.request_id
        if op == Opcode.NODE_AUTH:
            self._node_auth(conn, rid, frame)
            return
        if op == Opcode.NODE_PROOF:
            self._node_proof(conn, rid, frame)
            return
        if op in _PEER_OPS and not conn.peer_node:
            raise PermissionDenied(f"{Opcode(op).name} is for nodes of the pool (log in with NODE_AUTH)")
        if op in GRANT_OPCODES:         # the NIXL transport's holder side
            serve_grants(self.grants, conn, frame)
        elif op == Opcode.ANNOUNCE:
            node, epoch, items = wire.decode_announce(frame.header, self.limits)
            self._own_records(conn, op, node, epoch)
            if node != self.node_id:            # this node's blocks are the store's own records
                m = self.view.get(node)
                if (m is None or m.epoch != epoch) and (node, epoch) not in self._unseen:
                    self._unseen[(node, epoch)] = time.monotonic()
                for ekey, size, crc in items:
                    self.records.add(conn.key_of(ekey), node, epoch, size, crc, ekey)
            conn.finish(rid, op)
        elif op == Opcode.WITHDRAW:
            node, epoch, keys = wire.decode_withdraw(frame.header, self.limits)
            self._own_records(conn, op, node, epoch)
            for ekey in keys:
                self.records.drop(conn.key_of(ekey), node, epoch, ekey)
            conn.finish(rid, op)
        elif op == Opcode.REPLICATE:
            items = wire.decode_replicate(frame.header, self.limits)
            for ekey, _size, _crc in items:
                conn.key_of(ekey)               # well formed, or the request is refused
            self.background(self._take_replicas(conn.peer_node, conn.peer_epoch, items))
            conn.finish(rid, op)
        elif op == Opcode.LOCATE:
            self.counters["locates_served"] += 1
            per_key = self.records.live_holders(wire.decode_locate(frame.header, self.limits), self._is_live)
            conn.finish(rid, op, wire.encode_locate_reply(per_key, self.limits))
        elif op == Opcode.FETCH:
            self._serve_fetch(conn, rid, frame)
        elif op == Opcode.CLUSTER_VIEW:
            conn.finish(rid, op, wire.encode_json(self.describe()))
        elif op == Opcode.CLUSTER_LOCATE:
            keys = [conn.key_of(k) for k in wire.decode_locate(frame.header, self.limits, "CLUSTER_LOCATE")]
            conn.spawn(self._cluster_locate(conn, rid, keys))
        else:
            raise InvalidArgument(f"opcode {op:#04x} is not a cluster request")

    def _own_records(self, conn, op: int, node: str, epoch: int) -> None:
        """ANNOUNCE and WITHDRAW name the records of the connection's own node and epoch only."""
        if node != conn.peer_node or epoch != conn.peer_epoch:
            self.counters["records_refused_sender"] += 1
            raise PermissionDenied(f"{Opcode(op).name} names node {node!r} epoch {epoch:x}; this connection "
                                   f"logged in as {conn.peer_node!r} epoch {conn.peer_epoch:x}")

    # ------------------------------------------------------------------ node login (responder side)

    def _node_auth(self, conn, rid: int, frame) -> None:
        """NODE_AUTH: the initiator's id, epoch, the id it expects here, its nonce; answer
        this node's nonce and MAC over the transcript (it proves the key; nothing else is
        granted until NODE_PROOF proves it back)."""
        initiator, epoch, responder, nonce_i = wire.decode_node_auth(frame.header)
        if self.keys is None or conn.peer_node or conn.tenant or conn in self._logins:
            self._login_refused(conn, rid, frame.opcode, "NODE_AUTH on a connection that cannot log in as a node")
            return
        if responder != self.node_id:
            self._login_refused(conn, rid, frame.opcode, f"this is node {self.node_id!r}, not {responder!r}")
            return
        login = _Login(initiator, epoch, self.node_id, self.epoch, nonce_i, secrets.token_bytes(wire.NONCE_BYTES))
        self._logins[conn] = login
        mac = self.keys.responder_mac(*login)
        conn.finish(rid, frame.opcode, wire.encode_node_auth_reply(self.node_id, login.responder_epoch,
                                                                   login.nonce_r, mac))

    def _node_proof(self, conn, rid: int, frame) -> None:
        mac = wire.decode_node_proof(frame.header)
        login = self._logins.pop(conn, None)
        if login is None or conn.peer_node or not hmac.compare_digest(mac, self.keys.initiator_mac(*login)):
            self._login_refused(conn, rid, frame.opcode, "node login failed")
            return
        conn.logged_in_as_node(login.initiator, login.epoch)     # a member connection from now on
        self.counters["logins"] += 1
        conn.finish(rid, frame.opcode)

    def _login_refused(self, conn, rid: int, op: int, why: str) -> None:
        """Refuse and close: a login gets one try per connection."""
        self._logins.pop(conn, None)
        self.counters["logins_refused"] += 1
        log.warning("cluster: node login from %s refused: %s", getattr(conn, "peer", "?"), why)
        conn.finish_error(rid, op, PermissionDenied(why))
        conn.close()

    def _is_live(self, node_id: str, epoch: int) -> bool:
        """Whether a holder is this node now, or a member of the view with that epoch."""
        if node_id == self.node_id:
            return epoch == self.epoch
        m = self.view.get(node_id)
        return m is not None and m.epoch == epoch

    def may_read(self, tenant: str, key: KvBlockKey) -> bool:
        """Whether the requesting tenant may read ``key``, as the holder's own server would
        decide on a local GET (its tenants, may_act_for); the store's identity guard runs after."""
        auth = self.auth
        return auth is None or auth.open_mode or auth.may_act_for(tenant, key.tenant_id)

    def _serve_fetch(self, conn, rid: int, frame) -> None:
        """FETCH: leases on the blocks in DRAM, in this loop turn; the first block that must
        be read from the SSD tier sends the rest off the loop (``_serve_fetch_async``)."""
        tenant, ekeys = wire.decode_fetch(frame.header, self.limits)
        keys = [conn.key_of(ekey) for ekey in ekeys]
        leases: list = []
        items: list[tuple[int, int]] = []
        store = self.store
        try:
            for i, key in enumerate(keys):
                # Another tenant's key is a miss, the same as an absent one.
                if not self.may_read(tenant, key):
                    items.append((NotFound.status, 0))
                    continue
                try:
                    lease = store.get_nowait(key)
                except _MISS as exc:
                    items.append((exc.status, 0))
                    continue
                if lease is None:
                    conn.spawn(self._serve_fetch_async(conn, rid, tenant, keys[i:], leases, items, frame.flags))
                    return
                leases.append(lease)
                items.append((0, lease.size))
        except BaseException:
            _release(leases)
            raise
        self._reply_fetch(conn, rid, leases, items, frame.flags)

    async def _serve_fetch_async(self, conn, rid: int, tenant: str, keys: list, leases: list, items: list,
                                 flags: int) -> None:
        try:
            for key in keys:
                if not self.may_read(tenant, key):
                    items.append((NotFound.status, 0))
                    continue
                try:
                    lease = self.store.get_nowait(key)
                    if lease is None:
                        lease = await self.store.get_async(key)     # SSD: read off the loop
                except _MISS as exc:
                    items.append((exc.status, 0))
                    continue
                leases.append(lease)
                items.append((0, lease.size))
        except BaseException as exc:
            _fetch_failed(conn, rid, leases, exc)
            return
        self._reply_fetch(conn, rid, leases, items, flags)

    def _reply_fetch(self, conn, rid: int, leases: list, items: list, flags: int) -> None:
        """The FETCH reply; a frame CRC trailer only if the request asked for one (a reader
        checks each block against its writer's CRC instead, docs/security.md)."""
        try:
            if not conn.is_in_flight(rid):
                _release(leases)
                return
            fit, kept = messages.get_many_reply_fit(items, self.limits.max_payload_bytes)   # the reader asks again
            _release(leases[kept:])
            leases, items = leases[:kept], items[:fit]
            body = wire.encode_fetch_reply(self.epoch, items, self.limits)
        except BaseException as exc:
            _fetch_failed(conn, rid, leases, exc)
            return
        self.counters["fetches_served"] += 1
        conn.finish(rid, Opcode.FETCH, body, [lease.view for lease in leases], crc=bool(flags & FLAG_PAYLOAD_CRC),
                    leases=leases)

    async def _cluster_locate(self, conn, rid: int, keys: list[KvBlockKey]) -> None:
        try:
            ekeys = [encode_key(k) for k in keys]
            found = await self._locate(ekeys)
            out = []
            for key, ekey, holders in zip(keys, ekeys, found):
                kh = key_hash(ekey)
                names = [h.node_id for h in holders]
                if self.store.exists(key):
                    names.insert(0, self.node_id)
                out.append({"key": ekey.hex(), "home": self.ring.home(kh),
                            "order": self.ring.order(kh), "holders": names})
            conn.finish(rid, Opcode.CLUSTER_LOCATE, wire.encode_json(out))
        except Exception as exc:
            conn.finish_error(rid, Opcode.CLUSTER_LOCATE, exc)

    # ------------------------------------------------------------------ operator view

    def describe(self) -> dict:
        members = []
        for node_id in sorted(set(self.view) | {self.node_id}):
            m = self.view.get(node_id)
            members.append({
                "node_id": node_id, "address": m.address if m else self.address,
                "epoch": f"{m.epoch:x}" if m else f"{self.epoch:x}",
                "capacity": m.capacity if m else 0, "free": m.free if m else 0,
                "version": m.version if m else self.version,
                "state": "up" if m else ("self (not in view)" if node_id == self.node_id else "gone"),
                "self": node_id == self.node_id})
        return {"node_id": self.node_id, "state": self.cluster_state, "epoch": f"{self.epoch:x}",
                "members": members, "info": self.info()}

    @property
    def cluster_state(self) -> str:
        if self.membership is None:
            return "static"
        return self.membership.state

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster_state": self.cluster_state, "cluster_node_id": self.node_id,
            "cluster_epoch": f"{self.epoch:x}", "cluster_members": len(self.view),
            "cluster_replicas": self.replicas, "cluster_placement": self.placement,
            "cluster_records": len(self.records), "cluster_held": len(self.held),
            "reannounce_active": self.reannounce_active, "reannounce_total": self.reannounce_total,
        }
        for k, v in self.counters.items():
            out[k] = v
        if self.membership is not None:
            for k, v in self.membership.stats().items():
                out[f"membership_{k}"] = v
        for k, v in self.transport.stats().items():
            out[f"transport_{k}"] = v
        if self.grants is not None:
            out.update(self.grants.stats())
        return out


def _fetch_failed(conn, rid: int, leases: list, exc: BaseException) -> None:
    """A FETCH that failed while holding ``leases``: release them, then answer the error's
    status; a cancellation (not an ``Exception``) is raised again once they are released."""
    _release(leases)
    if not isinstance(exc, Exception):
        raise exc
    conn.finish_error(rid, Opcode.FETCH, exc)


def default_node_id(cluster_node_id: str, node_id: str) -> str:
    return cluster_node_id or node_id or socket.gethostname()
