"""A pool of real quillcached processes sharing one real etcd, on loopback ports.

``Pool(tmp_path, etcd, n=3)`` starts n nodes (``node-a``, ``node-b``, ...) with
``[cluster] enabled``; ``pool.wait_members(n)`` waits until every node's view has n
members.  Used by tests/cluster, ``make cluster`` (scripts) and bench/cluster.py.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from quillcache.client import Client
from quillcache.cluster import wire
from quillcache.protocol.opcodes import Opcode
from tests._support.daemon import Daemon

__all__ = ["CREDENTIAL", "Pool", "cluster_view", "cluster_section"]

CREDENTIAL = "test-cluster-credential-0123456789"


def cluster_section(etcd_endpoint: str, node_id: str, *, lease_ttl: str = "2s", replicas: int = 1,
                    placement: str = "local", cache_remote: bool = False, hop_timeout: str = "500ms",
                    cluster_id: str = "test") -> str:
    return (f'enabled = true\netcd = ["{etcd_endpoint}"]\ncluster_id = "{cluster_id}"\n'
            f'node_id = "{node_id}"\nlease_ttl = "{lease_ttl}"\nreplicas = {replicas}\n'
            f'placement = "{placement}"\ncache_remote = {"true" if cache_remote else "false"}\n'
            f'hop_timeout = "{hop_timeout}"\ncredential = "{CREDENTIAL}"\n')


def cluster_view(addr: str, timeout: float = 5.0) -> dict:
    with Client(addr, timeout=timeout, token=CREDENTIAL) as c:     # a node's view: works with tenants too
        return wire.decode_json(c.call(Opcode.CLUSTER_VIEW).header)


class Pool:
    def __init__(self, tmp_path: Path, etcd_endpoint: str, n: int = 3, *, dram: str = "256MiB",
                 max_block: str = "16MiB", **cluster_kw) -> None:
        self.tmp = Path(tmp_path)
        self.etcd_endpoint = etcd_endpoint
        self.cluster_kw = cluster_kw
        self.dram = dram
        self.max_block = max_block
        self.nodes: dict[str, Daemon] = {}
        for i in range(n):
            self.add(chr(ord("a") + i), start=False)

    def add(self, letter: str, *, start: bool = True) -> Daemon:
        node_id = f"node-{letter}"
        d = self.tmp / node_id
        d.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(d, dram=self.dram, max_block=self.max_block, sections={
            "cluster": cluster_section(self.etcd_endpoint, node_id, **self.cluster_kw),
            "node": f'id = "{node_id}"'})
        self.nodes[node_id] = daemon
        if start:
            daemon.start()
        return daemon

    def start(self) -> "Pool":
        for daemon in self.nodes.values():
            daemon.start(wait=False)
        for daemon in self.nodes.values():
            daemon.wait_ready()
        return self

    def __getitem__(self, letter: str) -> Daemon:
        return self.nodes[f"node-{letter}"]

    def wait_members(self, n: int, nodes=None, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        nodes = nodes or [d for d in self.nodes.values() if d.proc is not None and d.proc.poll() is None]
        while time.monotonic() < deadline:
            try:
                if all(sum(m["state"] == "up" for m in cluster_view(d.addr)["members"]) == n for d in nodes):
                    return
            except Exception:
                pass
            time.sleep(0.05)
        views = {}
        for d in nodes:
            try:
                views[d.addr] = cluster_view(d.addr)
            except Exception as exc:
                views[d.addr] = repr(exc)
        raise AssertionError(f"views did not reach {n} members within {timeout} s: {json.dumps(views, indent=1)}")

    def info(self, letter: str) -> dict:
        with Client(self[letter].addr, token=CREDENTIAL) as c:
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
