"""KV events: the one codec of the vLLM KV-event wire format, its ZMQ publisher and consumer.

Wire format (vLLM's ``ZmqEventPublisher``; SGLang's publisher is the same design)::

    PUB  multipart  [topic, seq (8-byte big-endian), msgpack EventBatch]
    replay: a DEALER sends [b"", start_seq (8-byte BE)] to the publisher's ROUTER and gets
            one reply per buffered batch with seq >= start_seq, then an end marker of seq -1:
            [b"", topic, seq, payload]   (vLLM 0.33)
            [b"", seq, payload]          (SGLang, older vLLM)

An ``EventBatch`` is either array-like ``[ts, [events], dp_rank?]`` or a map
``{"ts", "events", "data_parallel_rank"}``.  An event is either array-like and tagged by its
first element (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name]``; SGLang stops after ``lora_id``) or, since vLLM PR #42892, a map
tagged by ``"type"`` with optional fields left out at their default.  Fields are selected
by name, unknown ones are ignored; a block hash is an int or bytes.

QuillCache nodes publish their own residency changes in this format (medium ``cpu`` or
``disk``, topic = node id) with one extra map field, ``quill_scope``
(``[tenant, model, tokenizer, adapter]``), which other consumers ignore.

Every input limit is checked before anything is built; a bad payload raises
``EventDecodeError`` naming what is wrong, and the consumer counts and skips it.
"""
from __future__ import annotations

import collections
import logging
from array import array
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import msgpack
import zmq

__all__ = [
    "BlockHash", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "EventBatch",
    "EventDecodeError", "EventLimits", "decode_batch", "encode_batch", "encode_seq", "decode_seq",
    "END_SEQ", "EventPublisher", "EventConsumer", "ConsumerStats", "hashes_as_bytes",
]

log = logging.getLogger("quillcache.control.events")

BlockHash = Union[int, bytes]

END_SEQ = -1                                   # replay end marker (sent as signed 8-byte BE)
_END_SEQ_BYTES = END_SEQ.to_bytes(8, "big", signed=True)

# Positional field order of the array-like encodings (the tag comes first).  SGLang's
# BlockStored is a prefix of vLLM's; trailing fields left at their default are omitted.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": ("medium",),
}


class EventDecodeError(ValueError):
    """A payload that is not a well-formed KV-event batch, or one over a limit."""


@dataclass(frozen=True, slots=True)
class EventLimits:
    """Explicit bounds on what one payload may carry, checked before building anything."""

    max_payload_bytes: int = 64 << 20          # bytes of one msgpack batch
    max_events: int = 65_536                   # events per batch
    max_hashes: int = 65_536                   # block hashes per event
    max_tokens: int = 4 << 20                  # token ids per event
    max_hash_bytes: int = 64                   # bytes of one bytes-typed block hash


DEFAULT_LIMITS = EventLimits()


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: Optional[BlockHash] = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    # QuillCache extension (pool residency): (tenant, model, tokenizer, adapter or None).
    quill_scope: Optional[tuple[str, str, str, Optional[str]]] = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: Optional[str] = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: Optional[str] = None


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...] = ()
    data_parallel_rank: Optional[int] = None


# --------------------------------------------------------------------------- decoding


def _hash(value: object, limits: EventLimits, what: str) -> BlockHash:
    if isinstance(value, bool):
        raise EventDecodeError(f"{what}: a block hash must be an int or bytes, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, (bytes, bytearray)):
        if len(value) > limits.max_hash_bytes:
            raise EventDecodeError(f"{what}: a {len(value)}-byte block hash "
                                   f"(at most {limits.max_hash_bytes})")
        return bytes(value)
    raise EventDecodeError(f"{what}: a block hash must be an int or bytes, not {type(value).__name__}")


def _hashes(value: object, limits: EventLimits, what: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, (list, tuple)):
        raise EventDecodeError(f"{what}: block_hashes must be an array")
    if len(value) > limits.max_hashes:
        raise EventDecodeError(f"{what}: {len(value)} block hashes (at most {limits.max_hashes})")
    return tuple(_hash(h, limits, what) for h in value)


def _opt_int(value: object, what: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventDecodeError(f"{what}: must be an integer")
    return value


def _opt_str(value: object, what: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise EventDecodeError(f"{what}: not UTF-8") from None
    if not isinstance(value, str):
        raise EventDecodeError(f"{what}: must be a string")
    return value


def _event(raw: object, limits: EventLimits, index: int) -> Optional[KvEvent]:
    """One event from either encoding; None for an event type this build does not know."""
    what = f"event {index}"
    if isinstance(raw, dict):
        tag = _opt_str(raw.get("type"), what + " type")
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw:
        tag = _opt_str(raw[0], what + " tag")
        names = _ARRAY_FIELDS.get(tag or "")
        if names is None:
            return None
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventDecodeError(f"{what}: neither a map nor a tagged array")
    if tag == "BlockStored":
        what = f"{what} (BlockStored)"
        tokens = fields.get("token_ids") or ()
        if not isinstance(tokens, (list, tuple)):
            raise EventDecodeError(f"{what}: token_ids must be an array")
        if len(tokens) > limits.max_tokens:
            raise EventDecodeError(f"{what}: {len(tokens)} token ids (at most {limits.max_tokens})")
        try:
            array("I", tokens)            # C-speed check: unsigned 32-bit integers
        except (OverflowError, TypeError):
            raise EventDecodeError(f"{what}: token_ids must be integers in 0..2**32-1") from None
        block_size = _opt_int(fields.get("block_size"), what + " block_size") or 0
        if block_size < 0:
            raise EventDecodeError(f"{what}: block_size {block_size} is negative")
        parent = fields.get("parent_block_hash")
        scope = fields.get("quill_scope")
        if scope is not None:
            if not isinstance(scope, (list, tuple)) or len(scope) != 4:
                raise EventDecodeError(f"{what}: quill_scope must be [tenant, model, tokenizer, adapter]")
            scope = tuple(_opt_str(s, what + " quill_scope") for s in scope)
            if any(s is None for s in scope[:3]):
                raise EventDecodeError(f"{what}: quill_scope tenant, model and tokenizer are required")
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes", ()), limits, what),
            parent_block_hash=None if parent is None else _hash(parent, limits, what),
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_id=_opt_int(fields.get("lora_id"), what + " lora_id"),
            medium=_opt_str(fields.get("medium"), what + " medium"),
            lora_name=_opt_str(fields.get("lora_name"), what + " lora_name"),
            quill_scope=scope,
        )
    if tag == "BlockRemoved":
        what = f"{what} (BlockRemoved)"
        return BlockRemoved(_hashes(fields.get("block_hashes", ()), limits, what),
                            _opt_str(fields.get("medium"), what + " medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(_opt_str(fields.get("medium"), what + " medium"))
    return None          # a newer event type: ignored, like an unknown field


def decode_batch(payload: bytes, limits: EventLimits = DEFAULT_LIMITS) -> EventBatch:
    """Decode one msgpack EventBatch in either encoding; unknown event types are skipped."""
    if len(payload) > limits.max_payload_bytes:
        raise EventDecodeError(f"payload of {len(payload)} bytes (at most {limits.max_payload_bytes})")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False,
                              max_array_len=max(limits.max_events, limits.max_hashes, limits.max_tokens),
                              max_map_len=1024, max_bin_len=limits.max_payload_bytes,
                              max_str_len=1 << 20)
    except Exception as exc:   # msgpack raises several unrelated types for bad input
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts", 0.0), raw.get("events", []), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError("the batch is neither [ts, events, ...] nor a map")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError("batch ts must be a number")
    if not isinstance(events, (list, tuple)):
        raise EventDecodeError("batch events must be an array")
    if len(events) > limits.max_events:
        raise EventDecodeError(f"{len(events)} events in one batch (at most {limits.max_events})")
    out = [e for e in (_event(raw_e, limits, i) for i, raw_e in enumerate(events)) if e is not None]
    return EventBatch(float(ts), tuple(out), _opt_int(rank, "data_parallel_rank"))


# --------------------------------------------------------------------------- encoding


def _event_map(event: KvEvent) -> dict:
    # vLLM's decoder requires the fields it declares without a default (lora_id, medium,
    # lora_name, even when None); fields with a default are left out, as omit_defaults does.
    if isinstance(event, BlockStored):
        out: dict = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                     "parent_block_hash": event.parent_block_hash,
                     "token_ids": list(event.token_ids), "block_size": event.block_size,
                     "lora_id": event.lora_id, "medium": event.medium, "lora_name": event.lora_name}
        if event.quill_scope is not None:
            out["quill_scope"] = list(event.quill_scope)
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if event.medium is None else \
            {"type": "AllBlocksCleared", "medium": event.medium}
    raise TypeError(f"not a KV event: {event!r}")


def _event_array(event: KvEvent) -> list:
    tag = type(event).__name__
    if tag not in _ARRAY_FIELDS:
        raise TypeError(f"not a KV event: {event!r}")
    values = []
    for name in _ARRAY_FIELDS[tag]:
        value = getattr(event, name)
        values.append(list(value) if isinstance(value, tuple) else value)
    while values and values[-1] is None:     # trailing defaults omitted
        values.pop()
    return [tag, *values]


def encode_batch(batch: EventBatch, encoding: str = "map") -> bytes:
    """msgpack of a batch: ``encoding="map"`` (vLLM >= PR #42892: events are maps tagged
    ``type``, the batch an array) or ``"array"`` (older vLLM and SGLang)."""
    if encoding == "map":
        events = [_event_map(e) for e in batch.events]
    elif encoding == "array":
        events = [_event_array(e) for e in batch.events]
    else:
        raise ValueError(f"encoding {encoding!r}: 'map' or 'array'")
    body: list = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventDecodeError(f"a sequence frame of {len(frame)} bytes (must be 8)")
    return int.from_bytes(frame, "big", signed=True)


# --------------------------------------------------------------------------- publisher


class EventPublisher:
    """A PUB socket and a replay ROUTER with a bounded ring of the last ``buffer_steps``
    batches, the same contract as vLLM's ``ZmqEventPublisher``.

    ``publish`` encodes, numbers, sends without blocking and keeps the batch for replay; a
    batch the PUB socket drops at its high-water mark is still replayable.  Replay requests
    are served by one background thread.  Thread-safe.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 encoding: str = "map", ctx: Optional[zmq.Context] = None) -> None:
        if buffer_steps <= 0:
            raise ValueError("buffer_steps must be positive")
        self._ctx = ctx or zmq.Context.instance()
        self.topic = topic.encode("utf-8")
        self.encoding = encoding
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0                      # batches the PUB socket refused (still replayable)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay: Optional[zmq.Socket] = None
        self.replay_endpoint: Optional[str] = None
        self._running = True
        self._thread: Optional[threading.Thread] = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve_replay, daemon=True,
                                            name="quillcache-event-replay")
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[KvEvent], ts: Optional[float] = None,
                data_parallel_rank: Optional[int] = None) -> int:
        """Publish one batch; returns its sequence number."""
        payload = encode_batch(EventBatch(time.time() if ts is None else ts, tuple(events),
                                          data_parallel_rank), self.encoding)
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        with self._lock:
            if not self._running:
                raise RuntimeError("publisher is closed")
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1
        return seq

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while self._running:
            try:
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if not self._running:
                    return
                raise
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("replay request of %d frames ignored", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            with self._lock:
                pending = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for seq, payload in pending:
                    sock.send_multipart((client, b"", self.topic, encode_seq(seq), payload))
                sock.send_multipart((client, b"", self.topic, _END_SEQ_BYTES, b""))
            except zmq.ZMQError as exc:      # the requester went away: nothing to do
                log.debug("replay to a departed client: %s", exc)

    def close(self) -> None:
        with self._lock:
            self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> "EventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- consumer


@dataclass
class ConsumerStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0                   # sequence gaps seen on the live stream
    replayed: int = 0               # batches recovered by replay
    lost: int = 0                   # batches neither received nor replayable
    replay_requests: int = 0
    decode_errors: int = 0
    restarts: int = 0               # the publisher's sequence went backwards
    last_seq: Optional[int] = None
    errors: list = field(default_factory=list)


BatchHandler = Callable[[int, EventBatch], None]


class EventConsumer:
    """SUB consumer of one publisher, with gap detection and replay over DEALER.

    ``on_batch(seq, batch)`` is called once per batch in sequence order.  ``on_reset()`` is
    called when the publisher restarted (its sequence went back) or when batches were lost
    for good, so the caller can drop what it learnt from that source.  Every wait is bounded:
    ``poll(timeout)`` returns after at most ``timeout`` (plus one bounded replay).
    """

    def __init__(self, endpoint: str, on_batch: BatchHandler, *,
                 replay_endpoint: Optional[str] = None, topic: bytes = b"",
                 on_reset: Optional[Callable[[], None]] = None,
                 replay_timeout: float = 1.0, replay_attempts: int = 3,
                 limits: EventLimits = DEFAULT_LIMITS, ctx: Optional[zmq.Context] = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self.replay_attempts = replay_attempts
        self.limits = limits
        self.stats = ConsumerStats()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._thread: Optional[threading.Thread] = None
        self._running = False

    @property
    def last_seq(self) -> Optional[int]:
        return self.stats.last_seq

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload, self.limits)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            if len(self.stats.errors) < 16:
                self.stats.errors.append(f"seq {seq}: {exc}")
            log.warning("KV event batch seq %d skipped: %s", seq, exc)
        else:
            self.stats.batches += 1
            self.stats.events += len(batch.events)
            self.on_batch(seq, batch)
        self.stats.last_seq = seq

    def _reset(self) -> None:
        if self.on_reset is not None:
            self.on_reset()

    def handle(self, frames: Sequence[bytes]) -> None:
        """Process one live multipart message ``[topic, seq, payload]``."""
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        try:
            seq = decode_seq(frames[1])
        except EventDecodeError:
            self.stats.decode_errors += 1
            return
        last = self.stats.last_seq
        if last is not None and seq <= last:
            # SUB never repeats a message: a smaller seq is a restarted publisher.
            self.stats.restarts += 1
            self._reset()
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            self.replay(last + 1, seq)
            if self.stats.last_seq is not None and self.stats.last_seq >= seq:
                return       # the replay already delivered this batch
            if self.stats.last_seq is None or self.stats.last_seq < seq - 1:
                missing = seq - 1 - (self.stats.last_seq if self.stats.last_seq is not None else last)
                self.stats.lost += missing
                log.warning("KV events: %d batches lost before seq %d", missing, seq)
                self._reset()
        self._deliver(seq, frames[2])

    def replay(self, start: int, until: int) -> None:
        """Ask the publisher for batches ``start .. until-1`` (more may come: those up to its
        newest are applied too).  Re-requests from the last seq seen when replies stop before
        the end marker; at most ``replay_attempts`` requests, each reply waited for at most
        ``replay_timeout`` seconds."""
        if self.replay_endpoint is None:
            return
        for _ in range(self.replay_attempts):
            self.stats.replay_requests += 1
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(self.replay_endpoint)
                dealer.send_multipart((b"", encode_seq(start)))
                ended = behind = False
                while True:
                    if not dealer.poll(int(self.replay_timeout * 1000)):
                        break                           # replies dropped: re-request below
                    frames = dealer.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) == 3:
                        frames = frames[1:]             # vLLM 0.33 sends the topic too
                    if len(frames) != 2 or len(frames[0]) != 8:
                        self.stats.decode_errors += 1
                        continue
                    seq = decode_seq(frames[0])
                    if seq == END_SEQ:
                        ended = True
                        break
                    last = self.stats.last_seq
                    if last is not None and seq <= last:
                        continue                        # already applied
                    if last is not None and seq > last + 1:
                        behind = True                   # the ring no longer holds what we need
                        break
                    self.stats.replayed += 1
                    self._deliver(seq, frames[1])
            finally:
                dealer.close(linger=0)
            last = self.stats.last_seq
            if ended or behind or (last is not None and last >= until - 1):
                return
            if last is not None:
                if last + 1 > start:
                    start = last + 1
                elif last + 1 < start:
                    return

    def poll(self, timeout: float = 0.1) -> int:
        """Process the messages that arrive within ``timeout`` seconds; returns how many."""
        n = 0
        deadline = time.monotonic() + timeout
        while True:
            wait = max(0.0, deadline - time.monotonic())
            if not self._sub.poll(int(wait * 1000)):
                return n
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle(frames)
                n += 1
            if time.monotonic() >= deadline:
                return n

    def start(self) -> None:
        """Consume in a background thread until ``close``."""
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="quillcache-event-sub")
        self._thread.start()

    def _run(self) -> None:
        while self._running:
            try:
                self.poll(0.1)
            except zmq.ZMQError:
                if not self._running:
                    return
                raise

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        self._sub.close(linger=0)

    def __enter__(self) -> "EventConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hashes_as_bytes(hashes: Iterable[BlockHash]) -> list[bytes]:
    """Canonical bytes of block hashes (an int as 8-byte big-endian two's complement, or
    16 bytes when it does not fit)."""
    out = []
    for h in hashes:
        if isinstance(h, int):
            if -(1 << 63) <= h < (1 << 64):
                out.append((h & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big"))
            else:
                out.append((h & ((1 << 128) - 1)).to_bytes(16, "big"))
        else:
            out.append(h)
    return out
