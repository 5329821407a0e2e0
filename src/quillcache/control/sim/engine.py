"""The simulated engine as a pure model: a paged prefix cache and a continuous-batching
scheduler, driven by whoever owns the clock.

Nothing here does I/O or reads a clock.  ``SimEngine.plan_step(now_us)`` decides the next
iteration (which decodes run, which prefill chunks, which requests are admitted) and returns
its duration from the ``CostModel``; ``finish_step()`` applies it and returns what happened
(first tokens, finished requests, KV events).  The HTTP server drives it in real time; the
trace replay drives many of them on one virtual clock, fast and deterministic.

The model, in the way vLLM V1 schedules:

* The KV cache is ``capacity_blocks`` pages of ``block_size`` tokens.  A full prompt block,
  once computed, is stored under a chain hash of (parent hash, content, identity) and can be
  shared by later requests of the SAME identity (model, tokenizer, adapter, tenant): the identity enters
  every block's hash, the way vLLM's ``cache_salt`` and LoRA name enter its ``extra_keys``, so
  a prefix cached for tenant A is a miss for tenant B.  Stored blocks no running request holds
  are evicted in LRU order when pages are needed (each eviction is a ``removed`` event).
* A request reserves at admission every page it will need (prompt plus ``max_tokens``), so
  no running request is ever preempted; one that cannot fit waits (FCFS, no overtaking).  A
  request larger than the whole cache is refused at submission.
* Each iteration has a token budget (``max_batched_tokens``): every running decode takes one
  token, then running prefills and newly admitted requests take chunks (chunked prefill).
  A prefix hit is capped at ``(prompt - 1) // block_size`` blocks: at least one prompt token
  is always computed, so the first token has logits (vLLM does the same).
* Duration of an iteration, in microseconds::

      prefill_us_per_token * prefill_tokens
    + (decode_us_per_token + running_decode_penalty_us * decodes)   if decodes > 0
    + pool transfer of the blocks loaded this iteration (CPU-DRAM tier cost)

* With a pool attached (``SimPool``), the uncached part of a prefix that the pool holds for the
  same identity is loaded instead of computed, at the cost model's CPU-DRAM transfer cost.
* Disaggregated serving: a request that names ``remote_blocks`` (the prompt blocks a prefill
  engine computed, vLLM's ``kv_transfer_params.remote_block_ids``) loads them instead of
  computing them, at the same transfer cost (the stand-in for NIXL's RDMA read).
"""
from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Protocol, Sequence

from quillcache.control.model import H200_LLAMA3_8B, CostModel
from quillcache.model import CacheTier, IdentityScope, encode_scope

__all__ = [
    "EngineConfig", "SimRequest", "SimEngine", "StepPlan", "StepResult",
    "StoredBlock", "SimPool", "LruPool", "chain_hashes", "cost_with", "H200_LLAMA3_8B", "KV_BYTES_PER_TOKEN_LLAMA3_8B",
    "SimEngineError",
]

# Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes (bf16).
KV_BYTES_PER_TOKEN_LLAMA3_8B = 32 * 8 * 128 * 2 * 2        # 131072 bytes = 128 KiB




def cost_with(base: CostModel = H200_LLAMA3_8B, **knobs: Optional[int]) -> CostModel:
    """``base`` with the given knobs replaced (None keeps the base's value)."""
    fields = {}
    for name, value in knobs.items():
        if name not in ("prefill_us_per_token", "decode_us_per_token",
                        "running_decode_penalty_us", "cpu_dram_us_per_mb"):
            raise SimEngineError(f"unknown cost knob {name!r}")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SimEngineError(f"{name} {value!r}: must be an integer >= 0")
            fields[name] = value
    return replace(base, **fields)


HASH_BYTES = 32            # block hashes are 32-byte digests, as real engines publish them


class SimEngineError(ValueError):
    """A request the engine cannot take (too large for the cache, empty, bad field)."""


def chain_hashes(identity: IdentityScope, contents: Iterable[bytes]) -> list[bytes]:
    """The engine's block hashes: each covers its parent's hash, its content and the
    identity (model, tokenizer, adapter, tenant), so equal content under two identities
    never shares a block."""
    salt = encode_scope(identity)
    parent = b""
    out = []
    for content in contents:
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(salt)
        h.update(content)
        parent = h.digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16                    # tokens per KV page
    capacity_blocks: int = 4096             # KV pages in the cache
    max_num_seqs: int = 256                 # running requests at most
    max_batched_tokens: int = 2048          # tokens per iteration (chunked prefill budget)
    cost: CostModel = H200_LLAMA3_8B
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_LLAMA3_8B
    remote_us_per_mb: Optional[int] = None  # loading another engine's blocks; None: as the pool

    def __post_init__(self) -> None:
        for name in ("block_size", "capacity_blocks", "max_num_seqs", "max_batched_tokens",
                     "kv_bytes_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise SimEngineError(f"{name} {value!r}: must be a positive integer")
        if self.max_batched_tokens < self.max_num_seqs:
            raise SimEngineError(f"max_batched_tokens {self.max_batched_tokens} must be at least "
                                 f"max_num_seqs {self.max_num_seqs} (every decode needs a token)")

    def remote_load_us(self, blocks: int) -> int:
        if self.remote_us_per_mb is None:
            return self.pool_load_us(blocks)
        nbytes = blocks * self.block_size * self.kv_bytes_per_token
        return self.remote_us_per_mb * max(1, -(-nbytes // (1 << 20))) if blocks else 0

    def pool_load_us(self, blocks: int) -> int:
        nbytes = blocks * self.block_size * self.kv_bytes_per_token
        return self.cost.transfer_cost_us(CacheTier.CPU_DRAM, nbytes, same_worker=False,
                                          same_locality_domain=True) if blocks else 0


class SimPool(Protocol):
    """A KV pool the engine can load prefixes from (a QuillCache node, or a model of one)."""

    def match(self, identity: IdentityScope, hashes: Sequence[bytes]) -> int: ...   # leading blocks held
    def offer(self, identity: IdentityScope, blocks: Sequence["StoredBlock"]) -> None: ...


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request as the engine sees it.  ``block_hashes`` cover the full prompt blocks
    (``chain_hashes``); ``block_tokens`` (optional) their token ids, for the KV events."""

    request_id: str
    identity: IdentityScope
    prompt_tokens: int
    block_hashes: Sequence[bytes]
    max_tokens: int
    arrival_us: int = 0
    block_tokens: Optional[Callable[[int], Sequence[int]]] = None   # block index -> token ids
    tag: object = None                      # the driver's own handle
    remote_blocks: int = 0                  # leading prompt blocks a prefill engine computed (P/D)
    # --- state, owned by the engine
    state: str = "new"                      # new, waiting, prefill, decode, finished
    hit_blocks: int = 0                     # prefix blocks found in the engine's cache
    pool_blocks: int = 0                    # prefix blocks loaded from the pool
    remote_loaded: int = 0                  # prefix blocks loaded from the prefill engine
    computed: int = 0                       # prompt tokens with KV (hits included)
    stored_blocks: int = 0                  # full prompt blocks held in the cache
    private_blocks: int = 0                 # pages held that are not shared cache blocks
    decode_start_step: int = 0
    first_token_us: Optional[int] = None
    finish_us: Optional[int] = None

    def generated(self, step_index: int) -> int:
        """Output tokens produced by the end of iteration ``step_index``."""
        if self.state == "finished":
            return self.max_tokens
        if self.state != "decode":
            return 0
        return min(self.max_tokens, 1 + step_index - self.decode_start_step)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: bytes
    parent_hash: Optional[bytes]
    token_ids: Sequence[int]


@dataclass(slots=True)
class StepPlan:
    duration_us: int
    decodes: int
    prefill_tokens: int
    chunks: list                            # (request, tokens)
    admitted: list                          # requests admitted this iteration
    pool_loaded_blocks: int
    steps: int = 1                          # identical decode-only iterations planned as one


@dataclass(slots=True)
class StepResult:
    end_us: int
    first_tokens: list                      # requests whose first token came out this step
    finished: list                          # requests that produced their last token
    stored: list                            # (identity, parent_hash, [StoredBlock])
    removed: list                           # (identity, block_hash) evicted to make room


@dataclass(slots=True)
class _Block:
    identity: IdentityScope
    refs: int = 0


class SimEngine:
    """One engine's cache and scheduler.  Single-threaded; the driver owns the clock."""

    def __init__(self, config: EngineConfig = EngineConfig(), pool: Optional[SimPool] = None) -> None:
        self.config = config
        self.pool = pool
        self._blocks: dict[bytes, _Block] = {}              # stored blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()   # stored blocks with refs == 0
        self._private = 0                                     # pages held outside _blocks
        self._waiting: deque[SimRequest] = deque()
        self._prefilling: list[SimRequest] = []
        self._decoding = 0
        self._finish_heap: list = []                          # (finish step, seq, request)
        self._seq = 0
        self.step_index = 0
        self._plan: Optional[StepPlan] = None
        self._plan_start = 0
        self._evicted: list = []
        # counters
        self.prompt_tokens_total = 0
        self.hit_tokens_total = 0
        self.pool_tokens_total = 0
        self.remote_tokens_total = 0      # loaded from a prefill engine (disaggregated decode)
        self.aborted = 0                  # requests dropped before their end (client gone)
        self.cross_identity_hits = 0       # hits on a block stored for another identity: must stay 0
        self.busy_us = 0                  # modelled time in iterations
        self.prefill_busy_us = 0          # ... in iterations with prefill work running or waiting

    # ------------------------------------------------------------------ queries

    @property
    def used_blocks(self) -> int:
        return len(self._blocks) + self._private

    @property
    def free_blocks(self) -> int:
        return self.config.capacity_blocks - self.used_blocks

    @property
    def running(self) -> int:
        return len(self._prefilling) + self._decoding

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def resident(self) -> list[bytes]:
        return list(self._blocks)

    # ------------------------------------------------------------------ requests

    def blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return -(-(prompt_tokens + max_tokens) // self.config.block_size)

    def submit(self, req: SimRequest) -> None:
        cfg = self.config
        if req.prompt_tokens <= 0:
            raise SimEngineError("the prompt is empty")
        if req.max_tokens <= 0:
            raise SimEngineError(f"max_tokens {req.max_tokens}: must be at least 1")
        if len(req.block_hashes) != req.prompt_tokens // cfg.block_size:
            raise SimEngineError(f"{len(req.block_hashes)} block hashes for a prompt of "
                                 f"{req.prompt_tokens} tokens in blocks of {cfg.block_size}")
        need = self.blocks_needed(req.prompt_tokens, req.max_tokens)
        if need > cfg.capacity_blocks:
            raise SimEngineError(f"prompt {req.prompt_tokens} + max_tokens {req.max_tokens} tokens "
                                 f"need {need} KV blocks; the cache holds {cfg.capacity_blocks}")
        if req.state != "new":
            raise SimEngineError(f"request {req.request_id} was already submitted")
        req.state = "waiting"
        self._waiting.append(req)

    # ------------------------------------------------------------------ one iteration

    def plan_step(self, now_us: int, until_us: Optional[int] = None) -> Optional[StepPlan]:
        """Decide the next iteration starting at ``now_us``; None when there is nothing
        to run.  Admission (and the evictions it needs) happens here.

        With ``until_us`` (the driver knows nothing reaches this engine before then), a
        run of decode-only iterations is planned as one: as many as end by ``until_us``,
        and no further than the next request's last token.  The outcome is exactly that
        of planning them one by one."""
        if self._plan is not None:
            raise RuntimeError("plan_step called twice without finish_step")
        cfg = self.config
        budget = cfg.max_batched_tokens - self._decoding
        chunks = []
        prefill_tokens = 0
        for req in self._prefilling:
            if budget <= 0:
                break
            take = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, take))
            budget -= take
            prefill_tokens += take
        admitted = []
        pool_loaded = 0
        remote_loaded = 0
        while self._waiting and budget > 0 and self.running + len(admitted) < cfg.max_num_seqs:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            admitted.append(req)
            pool_loaded += req.pool_blocks + req.remote_loaded
            remote_loaded += req.remote_loaded
            take = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, take))
            budget -= take
            prefill_tokens += take
        self._prefilling.extend(admitted)
        decodes = self._decoding
        if not chunks and not decodes:
            return None
        cost = cfg.cost
        duration = (cost.prefill_us_per_token * prefill_tokens + cfg.pool_load_us(pool_loaded - remote_loaded)
                    + cfg.remote_load_us(remote_loaded))
        if decodes:
            duration += cost.decode_us_per_token + cost.running_decode_penalty_us * decodes
        duration = max(1, duration)
        steps = 1
        if until_us is not None and not chunks and not self._waiting:
            to_finish = self._finish_heap[0][0] - self.step_index
            steps = max(1, min(to_finish, (until_us - now_us) // duration))
        self._plan = StepPlan(duration * steps, decodes, prefill_tokens, chunks, admitted,
                              pool_loaded, steps)
        self._plan_start = now_us
        return self._plan

    def prefill_busy_at(self, now_us: int) -> int:
        """``prefill_busy_us`` as of ``now_us``: with the part of the iteration in flight that
        has run by then, where it has prefill work running or waiting (as ``finish_step`` will
        count it)."""
        plan = self._plan
        if plan is None or not (plan.prefill_tokens or self._waiting):
            return self.prefill_busy_us
        return self.prefill_busy_us + min(max(now_us - self._plan_start, 0), plan.duration_us)

    def finish_step(self) -> StepResult:
        plan = self._plan
        if plan is None:
            raise RuntimeError("finish_step without plan_step")
        self._plan = None
        end = self._plan_start + plan.duration_us
        self.busy_us += plan.duration_us
        if plan.prefill_tokens or self._waiting:
            self.prefill_busy_us += plan.duration_us
        self.step_index += plan.steps
        step = self.step_index
        bs = self.config.block_size
        first, finished, stored = [], [], []
        for req, take in plan.chunks:
            req.computed += take
            full = req.computed // bs
            if full > req.stored_blocks:
                blocks = self._store(req, req.stored_blocks, full)
                if blocks:
                    stored.append((req.identity, blocks[0].parent_hash, blocks))
            if req.computed == req.prompt_tokens:
                req.first_token_us = end
                first.append(req)
                if req.max_tokens == 1:
                    self._finish(req, end)
                    finished.append(req)
                else:
                    req.state = "decode"
                    req.decode_start_step = step
                    self._decoding += 1
                    self._seq += 1
                    heapq.heappush(self._finish_heap,
                                   (step + req.max_tokens - 1, self._seq, req))
        if first:
            self._prefilling = [r for r in self._prefilling if r.state == "prefill"]
        heap = self._finish_heap
        while heap and heap[0][0] <= step:
            req = heapq.heappop(heap)[2]
            self._decoding -= 1
            self._finish(req, end)
            finished.append(req)
        removed = self._evicted
        self._evicted = []
        return StepResult(end, first, finished, stored, removed)

    # ------------------------------------------------------------------ cache

    def _admit(self, req: SimRequest) -> bool:
        cfg = self.config
        bs = cfg.block_size
        hashes = req.block_hashes
        limit = (req.prompt_tokens - 1) // bs
        hit = 0
        while hit < limit and hashes[hit] in self._blocks:
            hit += 1
        # Disaggregated decode: what the prefill engine computed is loaded, not recomputed.
        remote = max(0, min(req.remote_blocks, limit) - hit)
        pool = 0
        if self.pool is not None and hit + remote < limit:
            pool = min(self.pool.match(req.identity, hashes[hit + remote:limit]), limit - hit - remote)
        need = self.blocks_needed(req.prompt_tokens, req.max_tokens) - hit
        # Pages a hit pins are no longer evictable: count them out of what eviction can give.
        pinned_from_lru = sum(1 for h in hashes[:hit] if self._blocks[h].refs == 0)
        if self.free_blocks + len(self._lru) - pinned_from_lru < need:
            return False
        for h in hashes[:hit]:
            blk = self._blocks[h]
            if blk.identity != req.identity:
                self.cross_identity_hits += 1
            if blk.refs == 0:
                del self._lru[h]
            blk.refs += 1
        while self.free_blocks < need:
            victim, _ = self._lru.popitem(last=False)
            blk = self._blocks.pop(victim)
            self._evicted.append((blk.identity, victim))
            if self.pool is not None:
                self.pool.offer(blk.identity, (StoredBlock(victim, None, ()),))
        self._private += need
        req.state = "prefill"
        req.hit_blocks = hit
        req.pool_blocks = pool
        req.remote_loaded = remote
        req.stored_blocks = hit
        req.computed = (hit + remote + pool) * bs
        req.private_blocks = need
        self.prompt_tokens_total += req.prompt_tokens
        self.hit_tokens_total += hit * bs
        self.pool_tokens_total += pool * bs
        self.remote_tokens_total += remote * bs
        return True

    def _store(self, req: SimRequest, start: int, end: int) -> list[StoredBlock]:
        """Full prompt blocks [start, end) of ``req`` are computed: they join the cache."""
        out = []
        hashes = req.block_hashes
        for i in range(start, end):
            h = hashes[i]
            blk = self._blocks.get(h)
            if blk is None:
                self._blocks[h] = _Block(req.identity, 1)
                tokens = req.block_tokens(i) if req.block_tokens is not None else ()
                out.append(StoredBlock(h, hashes[i - 1] if i else None, tokens))
            else:
                # Computed concurrently by another request: share that copy, free ours.
                if blk.refs == 0:
                    del self._lru[h]
                blk.refs += 1
            self._private -= 1
            req.private_blocks -= 1
        req.stored_blocks = end
        if out and self.pool is not None:
            self.pool.offer(req.identity, out)
        return out

    def _finish(self, req: SimRequest, end_us: int) -> None:
        req.state = "finished"
        req.finish_us = end_us
        # Tail blocks first, so the LRU evicts a chain from its end (as vLLM frees them).
        for h in reversed(req.block_hashes[:req.stored_blocks]):
            blk = self._blocks[h]
            blk.refs -= 1
            if blk.refs == 0:
                self._lru[h] = None
        self._private -= req.private_blocks
        req.private_blocks = 0

    def abort(self, req: SimRequest, now_us: int) -> None:
        """Drop a request (the client went away): its pages are released at once."""
        if req.state in ("waiting", "prefill", "decode"):
            self.aborted += 1
        if req.state == "waiting":
            self._waiting.remove(req)
            req.state = "finished"
            req.finish_us = now_us
        elif req.state in ("prefill", "decode"):
            if self._plan is not None and any(r is req for r, _ in self._plan.chunks):
                raise RuntimeError("abort during an iteration: call it between steps")
            if req.state == "prefill":
                self._prefilling.remove(req)
            else:
                self._decoding -= 1
                self._finish_heap = [e for e in self._finish_heap if e[2] is not req]
                heapq.heapify(self._finish_heap)
            self._finish(req, now_us)


class LruPool:
    """A model of a QuillCache pool the engines share: ``capacity_blocks`` blocks, LRU,
    keyed by the engines' identity-salted hashes (so, like the node's guard, it serves a
    block only to its own identity).  Engines offer every block they compute (write-through)
    and load the longest prefix it holds instead of computing it."""

    def __init__(self, capacity_blocks: int) -> None:
        if not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise SimEngineError(f"pool capacity {capacity_blocks!r}: must be a positive integer")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, IdentityScope] = OrderedDict()
        self.loaded_blocks = 0
        self.record = False                 # keep what changed, for the pool's residency events
        self.stored: list[tuple[IdentityScope, bytes]] = []
        self.removed: list[tuple[IdentityScope, bytes]] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, identity: IdentityScope, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        self.loaded_blocks += n
        return n

    def offer(self, identity: IdentityScope, blocks: Sequence[StoredBlock]) -> None:
        for b in blocks:
            if b.block_hash in self._blocks:
                self._blocks.move_to_end(b.block_hash)
                continue
            self._blocks[b.block_hash] = identity
            if self.record:
                self.stored.append((identity, b.block_hash))
        while len(self._blocks) > self.capacity_blocks:
            h, ident = self._blocks.popitem(last=False)
            if self.record:
                self.removed.append((ident, h))

    def drain(self) -> tuple[list, list]:
        """What was stored and removed since the last drain (with ``record`` on)."""
        out = (self.stored, self.removed)
        self.stored, self.removed = [], []
        return out
