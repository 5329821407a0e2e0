"""Network namespaces joined by veth pairs to a bridge, for tests that need a real network
between nodes (a partition, not only a dead process).  Needs root and ``ip netns``.

    with Netns(["etcd", "a", "b", "c"]) as net:
        net.ip("a")                 # 10.77.N.11
        net.run("hub", argv)        # a command inside a namespace
        net.partition("a") / net.heal("a")

The bridge lives in a namespace of its own (``hub``, address .1), so the host's own
namespace only ever holds a veth end for the moment it takes to move it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess

__all__ = ["Netns", "netns_available"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"qcprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired):
        return False
    try:
        _ip("netns", "del", name)
    except subprocess.CalledProcessError:
        pass
    return True


class Netns:
    def __init__(self, members: list[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.net = 64 + secrets.randbelow(128)          # 10.77.<net>.0/24
        self.members = list(members)
        self.hub = f"qc{self.tag}-hub"
        self.made: list[str] = []

    def ns(self, member: str) -> str:
        return self.hub if member == "hub" else f"qc{self.tag}-{member}"

    def ip(self, member: str) -> str:
        return f"10.77.{self.net}.1" if member == "hub" else f"10.77.{self.net}.{11 + self.members.index(member)}"

    def _hub_end(self, member: str) -> str:
        return f"qc{self.tag}h{self.members.index(member)}"

    def __enter__(self) -> "Netns":
        try:
            _ip("netns", "add", self.hub)
            self.made.append(self.hub)
            _ip("-n", self.hub, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{self.ip('hub')}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, m in enumerate(self.members):
                ns = self.ns(m)
                _ip("netns", "add", ns)
                self.made.append(ns)
                hub_end, m_end = self._hub_end(m), f"qc{self.tag}m{i}"
                # created in the hub namespace, one end moved at once into the member's
                _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", m_end)
                _ip("-n", self.hub, "link", "set", m_end, "netns", ns)
                _ip("-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(m)}/24", "dev", m_end)
                _ip("-n", ns, "link", "set", m_end, "up")
        except BaseException:
            self.close()
            raise
        return self

    def cmd(self, member: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(member), *argv]

    def run(self, member: str, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(member, argv), capture_output=True, text=True, timeout=timeout)

    def partition(self, member: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_end(member), "down")

    def heal(self, member: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_end(member), "up")

    def close(self) -> None:
        for ns in reversed(self.made):      # deleting a namespace deletes its veth ends
            try:
                _ip("netns", "del", ns)
            except subprocess.CalledProcessError:
                pass
        self.made.clear()

    def __exit__(self, *exc) -> None:
        self.close()
