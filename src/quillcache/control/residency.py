"""A node's own residency changes published as vLLM KV events, so that any KV-event consumer
(our router, or Dynamo's) sees the QuillCache pool as a tier.

Each block that becomes resident is a ``BlockStored`` with the engine's block hash as the
node stores it (``key.block_hash`` as UTF-8 bytes), its parent (``key.prefix_hash``), no
token ids, ``block_size = key.token_count``, ``medium = "cpu"``, ``lora_name`` = the adapter
and ``quill_scope = [tenant, model, tokenizer, adapter]``; a block that leaves is a
``BlockRemoved``.  The topic is the node id.  Changes are gathered for at most
``flush_interval`` seconds (or ``max_batch`` events) into one batch.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from quillcache.control.events import BlockRemoved, BlockStored, EventPublisher, KvEvent
from quillcache.model import KvBlockKey

__all__ = ["ResidencyPublisher"]


class ResidencyPublisher:
    def __init__(self, node_id: str, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 buffer_steps: int = 10_000, flush_interval: float = 0.005, max_batch: int = 512) -> None:
        self.publisher = EventPublisher(endpoint, replay_endpoint, topic=node_id, buffer_steps=buffer_steps)
        self.flush_interval = flush_interval
        self.max_batch = max_batch
        self._pending: list[KvEvent] = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self.published = 0

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> Optional[str]:
        return self.publisher.replay_endpoint

    def __call__(self, resident: bool, key: KvBlockKey) -> None:
        """The store's ``on_residency`` hook."""
        h = key.block_hash.encode("utf-8")
        if resident:
            ev: KvEvent = BlockStored((h,), key.prefix_hash.encode("utf-8"), (), key.token_count,
                                      None, "cpu", key.adapter_id,
                                      (key.tenant_id, key.model_id, key.tokenizer_id, key.adapter_id))
        else:
            ev = BlockRemoved((h,), "cpu")
        self._pending.append(ev)
        if len(self._pending) >= self.max_batch:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()                 # no loop (a synchronous caller): publish now
            else:
                self._timer = loop.call_later(self.flush_interval, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            events, self._pending = self._pending, []
            self.publisher.publish(events)
            self.published += len(events)

    def close(self) -> None:
        self.flush()
        self.publisher.close()
