"""What the suites that talk to a real quillcached share: one DRAM-only node per setup
(bench/_local_node.py: TCP on a free loopback port and the Unix socket with the mapped
arena), the two addresses a client can use, and keys that differ per suite.

asv does not call ``teardown`` when ``setup`` raises, so ``OnNode.setup`` stops what it
started before it re-raises: a failed setup leaves no daemon behind."""
from __future__ import annotations

from bench._local_node import LocalNode
from quillcache.client import Client
from quillcache.model import KvBlockKey

ADDRESSES = ("tcp", "unix")       # how a client reaches the node: TCP, or the Unix socket + mapped arena


def keys(tag: str, n: int) -> list[KvBlockKey]:
    return [KvBlockKey("bench-model", "tok", None, "", f"asv-{tag}", f"{tag}-{i}", i, 16) for i in range(n)]


class OnNode:
    """A suite base: ``prepare(*params)`` runs with ``self.node`` started; whatever it puts in
    ``self.closing`` (clients, connector cores) is closed before the node stops."""

    dram = "256MiB"       # no huge pages and no prefault: the node starts in about a second
    max_block = "4MiB"

    def setup(self, *params):
        self.closing = []
        self.node = LocalNode(dram=self.dram, max_block=self.max_block, hugepages=False, prefault=False)
        self.node.__enter__()
        try:
            self.prepare(*params)
        except BaseException:
            self.teardown(*params)
            raise

    def teardown(self, *params):
        for c in reversed(self.closing):
            c.close()
        self.node.__exit__()

    def connect(self, address: str, **options) -> Client:
        c = Client(self.node.unix if address == "unix" else self.node.tcp, **options)
        self.closing.append(c)
        if address == "unix" and not c.shm:
            raise NotImplementedError(f"the Unix client did not map the arena: {c.shm_refused}")
        return c
