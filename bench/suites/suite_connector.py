"""asv suite: the engine-agnostic connector core (connectors/core.py) against a real node,
without torch: ``save`` then ``load`` of one request's chain of blocks, over TCP and over the
Unix socket with the arena mapped.  bench/connector.py runs 1,000 blocks of an 8B model's
2 MiB and sets the core against the raw client calls."""
from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope
from quillcache.model import IdentityScope

from ._node import ADDRESSES, OnNode

BLOCKS = 32                   # blocks per request (a 512-token prompt of 16-token blocks)
BLOCK_BYTES = 256 << 10       # bytes per block (a small model's 16-token block)


class ConnectorCoreIO(OnNode):
    params = list(ADDRESSES)
    param_names = ["address"]
    timeout = 60

    def prepare(self, address):
        self.core = ConnectorCore(self.node.unix if address == "unix" else self.node.tcp)
        self.closing.append(self.core)
        ident = IdentityScope(model_scope("bench-model", dtype="bfloat16", block_size=16, num_layers=32,
                                     layout="vllm"), "tok", None, "tenant-a")
        self.keys = chain_keys(ident, [0x1000 + i for i in range(BLOCKS)], block_size=16)
        self.src = [bytes([i]) * BLOCK_BYTES for i in range(BLOCKS)]
        self.dst = [bytearray(BLOCK_BYTES) for _ in range(BLOCKS)]
        if not self.core.save(self.keys, self.src):
            raise RuntimeError(f"connector save failed: {self.core.stats()}")
        if self.core.load(self.keys, self.dst) != BLOCKS or self.dst[-1][-1] != BLOCKS - 1:
            raise RuntimeError(f"connector load: wrong blocks: {self.core.stats()}")
        if address == "unix" and not self.core.shm:
            raise NotImplementedError("the connector's Unix client did not map the arena")

    def time_save(self, address):
        self.core.save(self.keys, self.src)

    def time_load(self, address):
        self.core.load(self.keys, self.dst)
