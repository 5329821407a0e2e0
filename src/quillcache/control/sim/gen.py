"""Generated Mooncake-format traces for the router sweep: workloads the conversation trace
does not cover, each from a seed and a few workload parameters (no field is fitted to a
result).

* ``rag_trace``: many requests over a few long shared documents.  Each request is a shared
  system prompt, one document (popularity Zipf over the documents) and a short question of its
  own; the answer is short to medium.
* ``agent_trace``: tool-using agents with long, growing contexts and short turns.  Each session
  starts from a shared system-and-tools prompt; every turn appends a tool result or user
  message to the session's context and produces a short output (a tool call); sessions overlap,
  turns of one session are spaced by the agent's think time.
* ``apps_trace``: several applications behind one endpoint.  Templated calls (classification,
  extraction: a long template shared by every call of its application, a short input of their
  own, a few tokens out) arrive beside open chat (one shared system block, then a long prompt
  of its own, log-normal in length, and a long answer).  The shape of Mooncake's original
  (arXiv) trace, where two templates carry 55 % of the requests: it asks whether a router
  keeps the templates' engines clear of the long prompts that share nothing with them.
* ``unique_trace``: nothing to reuse.  Prompts of uniform length, most of them starting with one
  shared system block and the rest with nothing shared, short to medium answers, Poisson
  arrivals: what is left to a router is balancing, and the engines' KV memory binds first.

Timestamps are milliseconds at speed-up 1; ``TRACE_BLOCK_TOKENS`` tokens per hash id, the last
(partial) block of a prompt gets an id of its own, as in Mooncake's traces.
"""
from __future__ import annotations

import numpy as np

from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["rag_trace", "agent_trace", "apps_trace", "unique_trace", "GENERATORS"]

B = TRACE_BLOCK_TOKENS


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(index: int, ts_ms: float, prefix_ids: list[int], tail_tokens: int, output: int,
             ids: _Ids) -> TraceRequest:
    """A prompt of the full blocks ``prefix_ids`` then ``tail_tokens`` tokens of its own."""
    full, part = divmod(tail_tokens, B)
    hash_ids = prefix_ids + ids.take(full + (1 if part else 0))
    return TraceRequest(index, ts_ms, len(prefix_ids) * B + tail_tokens, output, tuple(hash_ids))


def rag_trace(n: int, seed: int = 0, *, documents: int = 160, doc_blocks: tuple[int, int] = (8, 48),
              system_blocks: int = 2, zipf: float = 1.1, question_tokens: tuple[int, int] = (64, 600),
              output_tokens: tuple[int, int] = (32, 400), rate_per_s: float = 4.0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(system_blocks)
    docs = [system + ids.take(int(rng.integers(doc_blocks[0], doc_blocks[1] + 1))) for _ in range(documents)]
    weight = 1.0 / np.arange(1, documents + 1) ** zipf
    weight /= weight.sum()
    t = 0.0
    out = []
    for i in range(n):
        t += rng.exponential(1000.0 / rate_per_s)
        doc = docs[int(rng.choice(documents, p=weight))]
        out.append(_request(i, round(t, 3), list(doc), int(rng.integers(*question_tokens)),
                            int(rng.integers(*output_tokens)), ids))
    return out


def agent_trace(n: int, seed: int = 0, *, sessions: int = 64, system_blocks: int = 6,
                first_tokens: tuple[int, int] = (1000, 4000), turn_tokens: tuple[int, int] = (200, 3000),
                output_tokens: tuple[int, int] = (16, 160), max_context_tokens: int = 64_000,
                think_s: float = 20.0) -> list[TraceRequest]:
    """``sessions`` agents run at once; one that reaches ``max_context_tokens`` is replaced by a
    new session.  Each turn's prompt is the previous prompt, its output and the new input, so a
    turn reuses the whole previous context (its full blocks)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(system_blocks)
    heap: list[tuple[float, int]] = []
    ctx: dict[int, tuple[list[int], int]] = {}     # session -> (full-block ids, tokens of a partial tail)

    def new_session(sid: int, at: float) -> None:
        tokens = int(rng.integers(*first_tokens))
        ctx[sid] = (list(system), tokens)
        heap.append((at, sid))

    for s in range(sessions):
        new_session(s, float(rng.exponential(think_s * 1000.0)))
    next_sid = sessions
    out = []
    while len(out) < n:
        heap.sort()
        t, sid = heap.pop(0)
        blocks, tail = ctx[sid]
        out_tokens = int(rng.integers(*output_tokens))
        req = _request(len(out), round(t, 3), blocks, tail, out_tokens, ids)
        out.append(req)
        # The next turn: the prompt's full blocks stay; its partial tail, the output and the new
        # input become new content (the tail block's content changed: it has a new id).
        full = list(req.hash_ids[:req.input_length // B])
        grown = (req.input_length % B) + out_tokens + int(rng.integers(*turn_tokens))
        if len(full) * B + grown > max_context_tokens:
            del ctx[sid]
            new_session(next_sid, t + rng.exponential(think_s * 1000.0))
            next_sid += 1
            continue
        extra_full, tail = divmod(grown, B)
        ctx[sid] = (full + ids.take(extra_full), tail)
        heap.append((t + rng.exponential(think_s * 1000.0), sid))
    out.sort(key=lambda r: r.timestamp_ms)
    return [TraceRequest(i, r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
            for i, r in enumerate(out)]


def apps_trace(n: int, seed: int = 0, *, templates: tuple[tuple[int, float], ...] = ((12, 0.40), (5, 0.15)),
               input_tokens: tuple[int, int] = (16, 1200), template_output: tuple[int, int] = (3, 40),
               chat_median_tokens: float = 6900.0, chat_sigma: float = 1.0,
               chat_tokens: tuple[int, int] = (900, 120_000), chat_output: tuple[int, int] = (200, 700),
               rate_per_s: float = 6.7) -> list[TraceRequest]:
    """``templates``: (template blocks, share of the requests) per templated application; the
    rest is chat.  A templated call is its template then ``input_tokens`` of its own and
    ``template_output`` tokens out; a chat prompt is the shared system block then a log-normal
    length (``chat_median_tokens``, ``chat_sigma``, clipped to ``chat_tokens``) of its own.
    Poisson arrivals at ``rate_per_s``."""
    templated = np.array([share for _, share in templates])
    if templated.sum() >= 1.0:
        raise ValueError(f"apps_trace: templates {templates!r} leave no share for chat")
    shares = np.append(templated, 1.0 - templated.sum())
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(1)
    kinds = [ids.take(blocks) for blocks, _ in templates]
    t = 0.0
    out = []
    for i in range(n):
        t += rng.exponential(1000.0 / rate_per_s)
        k = int(rng.choice(len(shares), p=shares))
        if k < len(kinds):
            req = _request(i, round(t, 3), list(kinds[k]), int(rng.integers(*input_tokens)),
                           int(rng.integers(*template_output)), ids)
        else:
            own = int(np.clip(rng.lognormal(np.log(chat_median_tokens), chat_sigma), *chat_tokens)) - B
            req = _request(i, round(t, 3), list(system), own, int(rng.integers(*chat_output)), ids)
        out.append(req)
    return out


def unique_trace(n: int, seed: int = 0, *, system_share: float = 2 / 3, prompt_tokens: tuple[int, int] = (200, 9000),
                 output: tuple[int, int] = (5, 300), rate_per_s: float = 2.5) -> list[TraceRequest]:
    """``system_share`` of the prompts start with one shared system block; every other block of
    every prompt is its own.  Prompt lengths uniform in ``prompt_tokens`` (the system block
    counted), outputs uniform in ``output``, Poisson arrivals at ``rate_per_s``."""
    if not 0.0 <= system_share <= 1.0:
        raise ValueError(f"unique_trace: system_share {system_share!r} must be in 0..1")
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(1)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.exponential(1000.0 / rate_per_s)
        tokens = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        shared = list(system) if tokens > B and rng.random() < system_share else []
        answer = int(rng.integers(output[0], output[1] + 1))
        out.append(_request(i, round(t, 3), shared, tokens - len(shared) * B, answer, ids))
    return out


GENERATORS = {"rag": rag_trace, "agent": agent_trace, "apps": apps_trace, "unique": unique_trace}
