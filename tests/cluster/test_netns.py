"""The pool over a real network: etcd and three nodes in their own network namespaces,
joined by veth pairs to a bridge.  What loopback cannot show: a partition (no EOF, no
refused connect) is seen within the lease TTL, costs misses (never a hang or a wrong
byte), and the partitioned node comes back with a new epoch and serves again."""
from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from tests._support.cluster import cluster_section
from tests._support.etcd import EtcdServer, etcd_binary
from tests._support.netns import Netns, netns_available
from tests._support.daemon import QUILLCACHED, Daemon

pytestmark = pytest.mark.skipif(etcd_binary() is None or not netns_available(),
                                reason="needs etcd and root with `ip netns`")

TTL_S = 2.0
PORT = 7470


class NsDaemon(Daemon):
    """quillcached inside a namespace, listening on that namespace's address."""

    def __init__(self, tmp_path, net: Netns, member: str, etcd_endpoint: str) -> None:
        self.net, self.member = net, member
        super().__init__(tmp_path, port=PORT, sections={
            "cluster": cluster_section(etcd_endpoint, f"node-{member}", lease_ttl=f"{TTL_S}s",
                                       hop_timeout="300ms"),
            "node": f'id = "node-{member}"'})
        text = self.config.read_text().replace(f'listen = "127.0.0.1:{PORT}"', f'listen = "{net.ip(member)}:{PORT}"')
        self.config.write_text(text)

    @property
    def addr(self) -> str:
        return f"{self.net.ip(self.member)}:{PORT}"

    def start(self, wait: bool = True) -> "NsDaemon":
        import subprocess
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.net.cmd(self.member, [QUILLCACHED, "--config", str(self.config)]),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quillcached exited with {self.proc.returncode}:\n{self.log()}")
            if " listening on " in self.log():
                return
            time.sleep(0.05)
        raise RuntimeError(f"quillcached did not start:\n{self.log()}")


def client(net: Netns, *argv) -> dict:
    r = net.run("hub", [sys.executable, "-m", "tests._support.netns_client", *map(str, argv)])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_partition_is_seen_within_the_ttl_costs_misses_and_heals_with_a_new_epoch(tmp_path):
    with Netns(["etcd", "a", "b", "c"]) as net:
        etcd = EtcdServer(tmp_path / "etcd", host=net.ip("etcd"), port=2379, netns=net.ns("etcd"))
        nodes = {}
        try:
            etcd.start()
            for m in "abc":
                (tmp_path / m).mkdir()
                nodes[m] = NsDaemon(tmp_path / m, net, m, etcd.endpoint).start(wait=False)
            for d in nodes.values():
                d.wait_ready()
            assert client(net, "members", nodes["a"].addr, 3, 20)["ok"]
            assert client(net, "members", nodes["b"].addr, 3, 20)["ok"]
            client(net, "put", nodes["a"].addr, 16, 64 << 10)
            time.sleep(0.2)
            for m in "bc":
                assert client(net, "get", nodes[m].addr, 16, 64 << 10)["hits"] == 16
            old = client(net, "epoch", nodes["b"].addr, "node-a")["epoch"]

            t_cut = time.monotonic()
            net.partition("a")
            gone = client(net, "gone", nodes["b"].addr, "node-a", TTL_S + 3)
            gone["seconds"] = time.monotonic() - t_cut       # an upper bound: includes the helper's start
            during = client(net, "get", nodes["c"].addr, 16, 64 << 10)
            net.heal("a")
            back = client(net, "members", nodes["b"].addr, 3, 15)
            new = client(net, "epoch", nodes["b"].addr, "node-a")["epoch"]
            deadline = time.monotonic() + 5
            while True:
                after = client(net, "get", nodes["c"].addr, 16, 64 << 10)
                if after["hits"] == 16 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            print(f"netns partition: seen gone in {gone['seconds']:.2f} s (ttl {TTL_S} s); reads while cut "
                  f"{during}; healed in {back['seconds']:.2f} s, epoch {old} -> {new}; reads after {after}")
            assert gone["ok"] and gone["seconds"] <= TTL_S + 1.0
            assert during["wrong"] == 0 and during["errors"] == 0 and during["slowest_s"] < 2.0
            assert back["ok"] and new not in (None, old)
            assert after["hits"] == 16 and after["wrong"] == 0
        finally:
            for d in nodes.values():
                if d.proc is not None and d.proc.poll() is None:
                    d.stop(signal.SIGKILL)
            etcd.close()
