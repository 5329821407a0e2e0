"""What the gateway knows of one engine: its spec, load, health and its event stream's liveness."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from quillcache.gateway.settings import EngineSpec
from quillcache.gateway.tokens import PromptTokenizer

__all__ = ["EngineState", "UNHEALTHY_RETRY_S"]

UNHEALTHY_RETRY_S = 5.0              # seconds: an engine that refused a connection rests this long


@dataclass
class EngineState:
    """What the gateway knows of one engine: load, health and the event stream's liveness."""

    spec: EngineSpec
    in_flight: int = 0
    routed: int = 0
    errors: int = 0
    hit_blocks: int = 0
    prompt_blocks: int = 0
    last_event: float = 0.0              # time.monotonic() of the last KV event batch (0: none yet)
    pending_since: float = 0.0           # first routed request since the last event (0: none)
    down_until: float = 0.0              # a failed connection rests the engine until then
    unhealthy_reason: str = ""
    tokenizer: Optional[PromptTokenizer] = field(default=None, repr=False)
    source: str = "config"               # "config" or "etcd"

    @property
    def id(self) -> str:
        return self.spec.id

    def healthy(self, now: float, unhealthy_after: float) -> bool:
        if now < self.down_until:
            self.unhealthy_reason = "connection refused recently"
            return False
        if self.spec.kv_events and self.pending_since and now - self.pending_since > unhealthy_after:
            # Requests went to it, yet no KV event came back for longer than the timeout.
            self.unhealthy_reason = f"no KV events for {now - self.pending_since:.1f}s while serving"
            return False
        self.unhealthy_reason = ""
        return True

    def on_events(self) -> None:
        """A KV event batch arrived (on the consumer's thread: two plain stores)."""
        self.last_event = time.monotonic()
        self.pending_since = 0.0
