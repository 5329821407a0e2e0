"""What one engine iteration tells the world: vLLM-format KV events.

Each run of blocks stored by one request is one ``BlockStored`` (block hashes, the parent's
hash, the blocks' token ids, the block size, the medium, the LoRA name) and evictions are
``BlockRemoved``.  The engine keys its cache by identity, so every ``BlockStored`` also names
the identity it was cached under in the ``quill_scope`` extension field: a consumer that
reads it (ours) scopes the blocks, one that ignores unknown fields (Dynamo's) sees the plain
vLLM event.  The wire format itself is ``quillcache.control.events``.
"""
from __future__ import annotations

from typing import Optional

from quillcache.control.events import BlockRemoved, BlockStored, KvEvent
from quillcache.control.sim.engine import StepResult
from quillcache.model import IdentityScope

__all__ = ["step_events", "scope_tuple", "DEVICE_MEDIUM"]

DEVICE_MEDIUM = "GPU"           # vLLM's medium for blocks in the engine's own KV cache


def scope_tuple(scope: IdentityScope) -> tuple[str, str, str, Optional[str]]:
    return (scope.tenant_id, scope.model_id, scope.tokenizer_id, scope.adapter_id)


def step_events(res: StepResult, block_size: int, medium: str = DEVICE_MEDIUM,
                identity: bool = True) -> list[KvEvent]:
    """The events of one iteration: evictions first (they made room), then stores.
    ``identity`` False leaves out ``quill_scope``: exactly what a vLLM engine publishes."""
    events: list[KvEvent] = []
    if res.removed:
        events.append(BlockRemoved(tuple(h for _, h in res.removed), medium))
    for scope, parent, blocks in res.stored:
        tokens: list[int] = []
        for b in blocks:
            tokens.extend(b.token_ids)
        events.append(BlockStored(
            block_hashes=tuple(b.block_hash for b in blocks),
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=block_size,
            medium=medium,
            lora_name=scope.adapter_id,
            quill_scope=scope_tuple(scope) if identity else None,
        ))
    return events
