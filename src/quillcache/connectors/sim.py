"""The simulated engine's pool on a real node (``quillcache-sim-engine --pool ADDRESS``).

A ``SimPool`` (control/sim/engine.py) over the connector core: ``match`` is a batched exists of
the request's leading block keys, ``offer`` a save that the engine does not wait for.  The
simulated engine has no KV bytes; each block's value is its 32-byte hash, so what the node
stores, counts and lists is real and the demo's second engine loads a prefix the first one
computed (``pool_tokens`` in its usage).  Keys are those of a chained-hash engine (SGLang's
convention): ``prefix_hash`` "" and ``block_index`` 0, because the engine's block hash already
covers its prefix and ``match`` starts wherever its own cache stops.
"""
from __future__ import annotations

from typing import Optional, Sequence

from quillcache.connectors.core import ConnectorCore, hash_hex
from quillcache.model import IdentityScope, KvBlockKey

__all__ = ["NodePool"]


class NodePool:
    """A simulated engine's pool: one node, through one ``ConnectorCore``."""

    def __init__(self, address: Optional[str] = None, *, token: Optional[str] = None, block_size: int = 16,
                 timeout: float = 2.0) -> None:
        self.block_size = int(block_size)
        self.core = ConnectorCore(address, token=token, timeout=timeout, name="sim-engine")

    def _keys(self, identity: IdentityScope, hashes: Sequence[bytes]) -> list[KvBlockKey]:
        return [KvBlockKey(identity.model_id, identity.tokenizer_id, identity.adapter_id, identity.tenant_id,
                           "", hash_hex(h), 0, self.block_size) for h in hashes]

    def match(self, identity: IdentityScope, hashes: Sequence[bytes]) -> int:
        """Leading blocks the node holds (0 on any failure: the engine computes them)."""
        return self.core.lookup(self._keys(identity, hashes)) if hashes else 0

    def offer(self, identity: IdentityScope, blocks: Sequence) -> None:
        """Store the engine's new blocks; the engine does not wait (a failure is counted)."""
        if blocks:
            self.core.save_async(self._keys(identity, [b.block_hash for b in blocks]),
                                 [bytes(b.block_hash) for b in blocks])

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    def close(self) -> None:
        self.core.close()
