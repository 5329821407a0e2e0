"""The gateway's settings: ``[gateway]``, ``[[gateway.engines]]``, ``[router]`` and ``[auth]``.

The same registry mechanism, TOML errors and exit codes as ``quillcached``
(quillcache.config); ``[auth]`` and ``[router]`` are the node's own ``Setting`` objects,
so a tenant table or a router knob means the same thing in both files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from quillcache.config import (
    SETTINGS, ConfigError, ConversionError, Registry, Setting, _int_range, _string,
    load_config, parse_byte_size, parse_duration, parse_hostport,
)

__all__ = ["GATEWAY_REGISTRY", "EngineSpec", "ENGINE_ROLES", "load_gateway_config", "MAX_ENGINES"]

MAX_ENGINES = 1024                    # [[gateway.engines]] entries at most
ENGINE_ROLES = ("both", "prefill", "decode")
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_ENGINE_KEYS = {"id", "url", "model", "tokenizer", "tokenizer_id", "chat_template", "adapters",
                "role", "kv_events", "kv_replay", "block_size"}
_ENGINE_REQUIRED = {"id", "url", "model"}
_ZMQ_RE = re.compile(r"^(tcp://[^\s]+:[0-9]+|ipc://\S+)$")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One upstream engine (an OpenAI-compatible server: vLLM, SGLang, the simulated engine)."""

    id: str
    url: str                          # base URL, e.g. http://127.0.0.1:8000
    model: str                        # the served (base) model name
    tokenizer: str = ""               # path of a local tokenizer.json; "" = approximate mode
    tokenizer_id: str = ""            # identity of the tokenizer; "" = the model name
    chat_template: str = ""           # path of a Jinja chat template; "" = the plain fallback
    adapters: tuple[str, ...] = ()    # LoRA adapters served under their own model names
    role: str = "both"
    kv_events: str = ""               # ZMQ endpoint of the engine's KV-event publisher
    kv_replay: str = ""               # ZMQ endpoint of its replay socket
    block_size: int = 16              # tokens per KV block (the engine's page size)

    @property
    def identity_tokenizer(self) -> str:
        return self.tokenizer_id or self.model


def _engines(value: Any) -> tuple[EngineSpec, ...]:
    example = '[[gateway.engines]] id = "e0" url = "http://127.0.0.1:8000" model = "llama-3-8b"'
    if not isinstance(value, list):
        raise ConversionError(f"not a list of engines (e.g. {example})")
    if len(value) > MAX_ENGINES:
        raise ConversionError(f"{len(value)} engines: at most {MAX_ENGINES}")
    out, seen = [], set()
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConversionError(f"entry {i} is not a table (e.g. {example})")
        unknown = set(item) - _ENGINE_KEYS
        if unknown:
            raise ConversionError(f"entry {i}: unknown key {sorted(unknown)[0]!r} "
                                  f"(known: {', '.join(sorted(_ENGINE_KEYS))})")
        missing = _ENGINE_REQUIRED - set(item)
        if missing:
            raise ConversionError(f"entry {i}: missing {', '.join(sorted(missing))} (e.g. {example})")
        for key in _ENGINE_KEYS - {"adapters", "block_size"}:
            if key in item and not isinstance(item[key], str):
                raise ConversionError(f"entry {i}: {key} must be a string")
        eid = item["id"]
        if not _ENGINE_ID_RE.match(eid):
            raise ConversionError(f"entry {i}: id {eid!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if eid in seen:
            raise ConversionError(f"entry {i}: engine {eid!r} is listed twice")
        seen.add(eid)
        url = item["url"].rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ConversionError(f"entry {i}: url {item['url']!r} must be http(s)://host:port")
        if not item["model"]:
            raise ConversionError(f"entry {i}: model must not be empty")
        adapters = item.get("adapters", [])
        if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
            raise ConversionError(f"entry {i}: adapters must be a list of names")
        role = item.get("role", "both")
        if role not in ENGINE_ROLES:
            raise ConversionError(f"entry {i}: role {role!r} is not one of {', '.join(ENGINE_ROLES)}")
        for key in ("kv_events", "kv_replay"):
            if item.get(key) and not _ZMQ_RE.match(item[key]):
                raise ConversionError(f"entry {i}: {key} {item[key]!r} is not a ZMQ endpoint "
                                      "(e.g. \"tcp://127.0.0.1:5557\")")
        if item.get("kv_replay") and not item.get("kv_events"):
            raise ConversionError(f"entry {i}: kv_replay needs kv_events")
        block_size = item.get("block_size", 16)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 4096:
            raise ConversionError(f"entry {i}: block_size must be an integer in 1..4096")
        out.append(EngineSpec(eid, url, item["model"], item.get("tokenizer", ""),
                              item.get("tokenizer_id", ""), item.get("chat_template", ""),
                              tuple(adapters), role, item.get("kv_events", ""),
                              item.get("kv_replay", ""), block_size))
    return tuple(out)


def _positive_duration(value: Any) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ConversionError('must be more than 0 (e.g. "10s")')
    return seconds


def _body_size(value: Any) -> int:
    n = parse_byte_size(value)
    if not 1024 <= n <= 1 << 30:
        raise ConversionError('out of range 1KiB..1GiB (e.g. "4MiB")')
    return n


_GATEWAY_SECTIONS = {
    "gateway": "The OpenAI-compatible gateway: where it listens, its limits, and its engines "
               "([[gateway.engines]] tables).",
    "router": "The routing policy and the cost-function knobs (the same router as a node's).",
    "auth": "API keys: each Bearer token maps to a tenant. With no tenants the gateway runs open "
            "(dev mode) and every request is the tenant \"\".",
}

_GATEWAY_SETTINGS: tuple[Setting, ...] = (
    Setting("gateway", "listen", parse_hostport, "127.0.0.1:8088", False,
            "Address of the HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
            "/health, /metrics)."),
    Setting("gateway", "engines", _engines, [], False,
            "Upstream engines as [[gateway.engines]] tables: id, url, model, and optionally "
            "tokenizer (a local tokenizer.json), tokenizer_id, chat_template (a Jinja file), "
            "adapters (LoRA names served), role (both, prefill, decode), kv_events and kv_replay "
            "(ZMQ endpoints of the engine's KV-event publisher), block_size (tokens per KV block)."),
    Setting("gateway", "max_body", _body_size, "4MiB", False,
            "Largest request body; a larger one is refused with 413 before it is read."),
    Setting("gateway", "max_prompt_tokens", _int_range(1, 1 << 24), 1 << 20, True,
            "Longest prompt in tokens (characters in approximate mode); longer ones get 400."),
    Setting("gateway", "queue_limit", _int_range(1, 1 << 20), 256, True,
            "Requests in flight per engine at most; when every engine is at it, 429 with Retry-After."),
    Setting("gateway", "retry_after", _positive_duration, "1s", True,
            "The Retry-After of a 429."),
    Setting("gateway", "connect_timeout", _positive_duration, "3s", True,
            "How long connecting to an engine may take before the request is retried elsewhere."),
    Setting("gateway", "first_byte_timeout", _positive_duration, "60s", True,
            "How long an engine may take to answer (headers) before the request fails over."),
    Setting("gateway", "idle_timeout", _positive_duration, "60s", True,
            "Longest silence inside a streamed answer before it is ended with an error event."),
    Setting("gateway", "unhealthy_after", _positive_duration, "15s", True,
            "An engine with kv_events whose event stream (or its heartbeat) is silent this long "
            "is marked unhealthy and not routed to."),
    Setting("gateway", "predict_ttl", _positive_duration, "120s", True,
            "How long a routed prefix counts as resident on its engine (predict-on-route) before "
            "the engine's events confirm it."),
    Setting("gateway", "slo_ttft", _positive_duration, "800ms", True,
            "Time-to-first-token objective used by the goodput metric."),
    Setting("gateway", "slo_tpot", _positive_duration, "80ms", True,
            "Time-per-output-token objective used by the goodput metric."),
    Setting("gateway", "name", _string, "", False,
            "Name of this gateway in logs and metrics; empty means the host name."),
)


def _policy(value: Any) -> str:
    from quillcache.control.router import POLICIES
    if isinstance(value, str) and value in POLICIES:
        return value
    raise ConversionError("not one of " + ", ".join(f'"{p}"' for p in POLICIES))


_NODE_ONLY = {("router", "module"), ("router", "engines"), ("router", "block_size"),
              ("router", "approximate"), ("router", "approx_ttl")}


def _shared(section: str) -> tuple[Setting, ...]:
    """The node's own settings of a section, less those that only a node has (a node hosts a
    router module over [[router.engines]]; the gateway routes [[gateway.engines]], each with
    its block size, and predicts residency with [gateway] predict_ttl)."""
    return tuple(s for s in SETTINGS if s.section == section and (s.section, s.name) not in _NODE_ONLY)


_ROUTER_POLICY = Setting("router", "policy", _policy, "quillcache", True,
                         "How the gateway picks an engine: quillcache (identity-scoped credit plus "
                         "pool credit), dynamo (Dynamo's cost function as shipped, identity-blind), "
                         "prefix, least_loaded or round_robin.")


def _check_gateway(cfg) -> None:
    first: dict[str, EngineSpec] = {}         # model -> its first engine
    for spec in cfg.gateway.engines:
        for name in spec.adapters:
            if name == spec.model:
                raise ConfigError(f"{cfg.source}: [[gateway.engines]] {spec.id}: adapter {name!r} "
                                  "is also the base model name")
        # One tokenizer and block size per model: the gateway hashes a prompt once, with them.
        other = first.setdefault(spec.model, spec)
        for field in ("tokenizer", "tokenizer_id", "chat_template", "block_size"):
            if getattr(spec, field) != getattr(other, field):
                raise ConfigError(f"{cfg.source}: [[gateway.engines]] {spec.id}: {field} "
                                  f"{getattr(spec, field)!r} differs from engine {other.id}'s "
                                  f"{getattr(other, field)!r}; engines of model {spec.model!r} "
                                  "must share it")


GATEWAY_REGISTRY = Registry("gateway", _GATEWAY_SECTIONS,
                            _GATEWAY_SETTINGS + (_ROUTER_POLICY,) + _shared("router") + _shared("auth"),
                            _check_gateway)


def load_gateway_config(path: Optional[str] = None, text: Optional[str] = None):
    """The gateway's validated config (from a file, TOML text, or the embedded defaults)."""
    return load_config(path, text, registry=GATEWAY_REGISTRY)
