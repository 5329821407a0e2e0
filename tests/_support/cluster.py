"""A pool of real quillcached processes sharing one real etcd, on loopback ports.

``Pool(tmp_path, etcd, n=3)`` starts n nodes (``node-a``, ``node-b``, ...) with
``[cluster] enabled``; ``pool.wait_members(n)`` waits until every node's view has n
members.  ``key``/``content`` name and fill test blocks (a wrong block is never equal to
the right one), ``Load`` reads and writes them in threads and counts what it saw.  Used by
tests/cluster, ``make cluster`` (scripts) and bench/cluster.py.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

from quillcache.client import Client
from quillcache.protocol import cluster as wire
from quillcache.errors import NotFound, QuillCacheError
from quillcache.model import KvBlockKey
from quillcache.protocol.opcodes import Opcode
from tests._support.daemon import Daemon

__all__ = ["CREDENTIAL", "Pool", "cluster_view", "cluster_section", "key", "content", "get_retry",
           "member_ids", "Load", "unix_addr", "member", "cluster_keys"]

CREDENTIAL = "test-cluster-credential-0123456789"


def cluster_section(etcd_endpoint: str, node_id: str, *, lease_ttl: str = "2s", replicas: int = 1,
                    placement: str = "local", cache_remote: bool = False, hop_timeout: str = "500ms",
                    cluster_id: str = "test", reannounce_rate: int = 20000, **more: str) -> str:
    return (f'enabled = true\netcd = ["{etcd_endpoint}"]\ncluster_id = "{cluster_id}"\n'
            f'node_id = "{node_id}"\nlease_ttl = "{lease_ttl}"\nreplicas = {replicas}\n'
            f'placement = "{placement}"\ncache_remote = {"true" if cache_remote else "false"}\n'
            f'hop_timeout = "{hop_timeout}"\ncredential = "{CREDENTIAL}"\n'
            f'reannounce_rate = {reannounce_rate}\n' + "".join(f'{k} = "{v}"\n' for k, v in more.items()))


def etcd_call(endpoint: str, path: str, body: dict) -> dict:
    import requests
    r = requests.post(f"http://{endpoint}/v3{path}", json=body, timeout=5)
    r.raise_for_status()
    return r.json()


def etcd_put(endpoint: str, key: str, value: bytes, lease: int = 0) -> None:
    """Write ``value`` under ``key`` as anyone who can write to etcd can."""
    import base64
    body = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
    if lease:
        body["lease"] = lease
    etcd_call(endpoint, "/kv/put", body)


def node_record(node_id: str, address: str, epoch: int, lease: int = 0, *, signed_for: str = "",
                cluster_id: str = "test") -> bytes:
    """A member record as a node writes it; ``signed_for``: the etcd key to sign it for with
    the pool's record key (only a holder of the credential can), else unsigned."""
    d = {"node_id": node_id, "address": address, "epoch": epoch, "capacity": 1 << 30, "free": 1 << 30,
         "version": "rogue", "started": time.time(), "lease": lease}
    if signed_for:
        content = json.dumps(d, sort_keys=True).encode()
        try:
            d["sig"] = cluster_keys(cluster_id).sign_record(signed_for, content)
        except ImportError:
            pass                                    # a build that signs nothing
    return json.dumps(d, sort_keys=True).encode()


def cluster_keys(cluster_id: str = "test"):
    from quillcache.cluster.keys import ClusterKeys
    return ClusterKeys(CREDENTIAL, cluster_id)


def member(addr: str, node_id: str, epoch: int = 7, *, peer_id: str, cluster_id: str = "test",
           timeout: float = 5.0) -> Client:
    """A client logged in as node ``node_id`` (epoch ``epoch``) of the pool, to the node
    ``peer_id`` at ``addr``: what another node's transport opens (transfer/tcp.py).  Against
    a build without the node login (the security probes run on the old code too), the
    login it had: HELLO with the credential."""
    if not hasattr(wire, "NodeLogin"):
        return Client(addr, timeout=timeout, token=CREDENTIAL)
    c = Client(addr, timeout=timeout, token=wire.NODE_HELLO_TOKEN)
    try:
        step = wire.NodeLogin(cluster_keys(cluster_id), node_id, epoch, peer_id)
        c.call(Opcode.NODE_PROOF, step.proof(c.call(Opcode.NODE_AUTH, step.request()).header))
    except BaseException:
        c.close()
        raise
    return c


def cluster_view(addr: str, timeout: float = 5.0, token=None) -> dict:
    with Client(addr, timeout=timeout, token=token) as c:     # a tenant's token where the node has tenants
        return wire.decode_json(c.call(Opcode.CLUSTER_VIEW).header)


class Pool:
    def __init__(self, tmp_path: Path, etcd_endpoint: str, n: int = 3, *, dram: str = "256MiB",
                 max_block: str = "16MiB", ssd: bool = False, sections: dict | None = None,
                 **cluster_kw) -> None:
        self.tmp = Path(tmp_path)
        self.etcd_endpoint = etcd_endpoint
        self.cluster_kw = cluster_kw
        self.dram = dram
        self.max_block = max_block
        self.ssd = ssd
        self.sections = dict(sections or {})       # more config: section -> lines
        self.nodes: dict[str, Daemon] = {}
        self.token = None                          # a tenant's token, once the nodes have tenants
        for i in range(n):
            self.add(chr(ord("a") + i), start=False)

    def add(self, letter: str, *, start: bool = True) -> Daemon:
        node_id = f"node-{letter}"
        d = self.tmp / node_id
        d.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(d, dram=self.dram, max_block=self.max_block, ssd=self.ssd, sections={
            **self.sections, "cluster": cluster_section(self.etcd_endpoint, node_id, **self.cluster_kw),
            "node": f'id = "{node_id}"'})
        self.nodes[node_id] = daemon
        if start:
            daemon.start()
        return daemon

    def start(self) -> "Pool":
        """Start every node, then wait for each; one that does not come up stops them all
        (``__exit__`` does not run when ``__enter__`` raises)."""
        try:
            for daemon in self.nodes.values():
                daemon.start(wait=False)
            for daemon in self.nodes.values():
                daemon.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __getitem__(self, letter: str) -> Daemon:
        return self.nodes[f"node-{letter}"]

    def wait_members(self, n: int, nodes=None, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        nodes = nodes or [d for d in self.nodes.values() if d.proc is not None and d.proc.poll() is None]
        while time.monotonic() < deadline:
            try:
                if all(sum(m["state"] == "up" for m in cluster_view(d.addr, token=self.token)["members"]) == n
                       for d in nodes):
                    return
            except Exception:
                pass
            time.sleep(0.05)
        views = {}
        for d in nodes:
            try:
                views[d.addr] = cluster_view(d.addr, token=self.token)
            except Exception as exc:
                views[d.addr] = repr(exc)
        raise AssertionError(f"views did not reach {n} members within {timeout} s: {json.dumps(views, indent=1)}")

    def info(self, letter: str) -> dict:
        with Client(self[letter].addr, token=self.token) as c:
            return c.info("cluster")

    def close(self) -> None:
        for daemon in self.nodes.values():
            if daemon.proc is not None and daemon.proc.poll() is None:
                try:
                    daemon.proc.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                daemon.stop(signal.SIGKILL)

    def __enter__(self) -> "Pool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def key(i: int, tenant: str = "t0") -> KvBlockKey:
    return KvBlockKey("m", "tok", None, tenant, f"p{i // 8}", f"b{i}")


def content(i: int, size: int) -> bytes:
    # every block differs from every other in its first bytes: a wrong block is never equal
    head = f"block-{i}-".encode()
    return (head + bytes((i * 7 + j) & 0xFF for j in range(251)) * (size // 251 + 1))[:size]


def get_retry(c: Client, k: KvBlockKey, timeout: float = 3.0) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return c.get(k)
        except NotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def member_ids(addr: str) -> set[str]:
    return {m["node_id"] for m in cluster_view(addr)["members"] if m["state"] == "up"}


class Load:
    """Readers (and a writer) in threads: every byte read is compared; counts hits, misses,
    errors and wrong blocks."""

    def __init__(self, addrs: list[str], keys: dict[int, int], writer_addr: str | None = None,
                 write_base: int = 10_000) -> None:
        self.addrs, self.keys = addrs, keys
        self.stop = threading.Event()
        self.hits = self.misses = self.errors = self.wrong = 0
        self.writes = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, args=(a,), daemon=True) for a in addrs]
        if writer_addr:
            self.threads.append(threading.Thread(target=self._write, args=(writer_addr, write_base), daemon=True))

    def _read(self, addr: str) -> None:
        c = None
        i = 0
        ids = sorted(self.keys)
        while not self.stop.is_set():
            k = ids[i % len(ids)]
            i += 1
            try:
                if c is None:
                    c = Client(addr, timeout=3.0)
                data = c.get(key(k))
                with self.lock:
                    if data == content(k, self.keys[k]):
                        self.hits += 1
                    else:
                        self.wrong += 1
            except NotFound:
                with self.lock:
                    self.misses += 1
            except QuillCacheError:
                with self.lock:
                    self.errors += 1
                if c is not None:
                    c.close()
                c = None
                time.sleep(0.01)
        if c is not None:
            c.close()

    def _write(self, addr: str, base: int) -> None:
        try:
            with Client(addr, timeout=3.0) as c:
                n = 0
                while not self.stop.is_set():
                    i = base + n % 50
                    c.put(key(i), content(i, 64 << 10))
                    n += 1
                    self.writes += 1
                    time.sleep(0.002)
        except QuillCacheError:
            pass                    # its node was killed

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def snapshot(self) -> tuple[int, int, int, int]:
        with self.lock:
            return self.hits, self.misses, self.errors, self.wrong


def unix_addr(daemon: Daemon) -> str:
    """The node's Unix socket (a trusted client maps its arena: docs/shm.md)."""
    return f"unix:{daemon.data_dir / 'quillcached.sock'}"
