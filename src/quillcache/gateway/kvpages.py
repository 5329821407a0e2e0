"""What an engine says of its KV memory, so the router's memory terms ([router] kv_blocks,
docs/router.md "KV memory") act without the operator writing the figure down.

* vLLM: ``GET /metrics``, the info gauge ``vllm:cache_config_info``, whose labels are the
  engine's ``CacheConfig``: ``num_gpu_blocks`` pages of ``block_size`` tokens (one sample per
  data-parallel engine; the smallest counts).
* SGLang: ``GET /server_info`` (``/get_server_info`` before it): ``max_total_num_tokens``.
* The simulated engine answers as vLLM does.

An engine that answers neither says nothing (None): the router keeps what it had.  What is read
is bounded (``MAX_ANSWER_BYTES``, before it is parsed), and the figure is believed only within
``MAX_KV_TOKENS``: a peer that answers in the engine's place costs this one bounded read and
can at most make the memory terms wrong for its own model's engines, which the operator's
``[router] kv_blocks`` overrides.
"""
from __future__ import annotations

import json
from typing import Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from quillcache.gateway.http import read_at_most

__all__ = ["MAX_ANSWER_BYTES", "MAX_KV_TOKENS", "VLLM_INFO", "fetch_kv_tokens", "kv_tokens_from_vllm_metrics",
           "kv_tokens_from_sglang_info"]

MAX_ANSWER_BYTES = 4 << 20            # an engine's /metrics or server info, read at most
MAX_KV_TOKENS = 1 << 40               # the most KV tokens an engine is believed to hold
VLLM_INFO = "vllm:cache_config_info"
_SGLANG_PATHS = ("/server_info", "/get_server_info")


def _count(value) -> Optional[int]:
    """A positive integer within MAX_KV_TOKENS from a label or a JSON field, else None."""
    if isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if 0 < n <= MAX_KV_TOKENS else None


def kv_tokens_from_vllm_metrics(text: str) -> Optional[int]:
    """The KV tokens a vLLM engine holds (``num_gpu_blocks`` x ``block_size`` of its
    ``vllm:cache_config_info``; the smallest over its data-parallel engines), or None."""
    lines = [ln for ln in text.splitlines() if ln.startswith(VLLM_INFO + "{")]
    if not lines:
        return None
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError:
        return None
    found = []
    for fam in families:
        for sample in fam.samples:
            blocks, size = _count(sample.labels.get("num_gpu_blocks")), _count(sample.labels.get("block_size"))
            if blocks is not None and size is not None and blocks * size <= MAX_KV_TOKENS:
                found.append(blocks * size)
    return min(found) if found else None


def kv_tokens_from_sglang_info(doc) -> Optional[int]:
    """The KV tokens an SGLang server holds (its server info's ``max_total_num_tokens``), or None."""
    return _count(doc.get("max_total_num_tokens")) if isinstance(doc, dict) else None


async def _get(session: aiohttp.ClientSession, url: str, timeout: float) -> Optional[bytes]:
    """The body of a 200 answer, at most MAX_ANSWER_BYTES (None: another status, or longer)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            return None
        if resp.content_length is not None and resp.content_length > MAX_ANSWER_BYTES:
            return None
        return await read_at_most(resp, MAX_ANSWER_BYTES)


async def fetch_kv_tokens(session: aiohttp.ClientSession, base_url: str, timeout: float) -> Optional[int]:
    """Ask the engine at ``base_url`` how many KV tokens it holds: vLLM's /metrics, then
    SGLang's server info.  None: it answered neither.  Connection errors and timeouts propagate
    (``aiohttp.ClientError``, ``asyncio.TimeoutError``): the caller may ask again later."""
    base = base_url.rstrip("/")
    body = await _get(session, base + "/metrics", timeout)
    if body is not None:
        n = kv_tokens_from_vllm_metrics(body.decode("utf-8", "replace"))
        if n is not None:
            return n
    for path in _SGLANG_PATHS:
        body = await _get(session, base + path, timeout)
        if body is None:
            continue
        try:
            doc = json.loads(body)
        except ValueError:
            continue
        n = kv_tokens_from_sglang_info(doc)
        if n is not None:
            return n
    return None
