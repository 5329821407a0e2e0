"""One engine as the control plane knows it (``EngineSpec``), and the one validator of the
tables that describe engines.

Two tables describe engines, each in its own words, both checked here field by field with
the same rules and the same messages:

* a node's ``[[router.engines]]`` (``NODE_TABLE``): an event source for the node's hosted
  router, its blocks indexed under the ``tenant`` and ``adapter`` it names;
* the gateway's ``[[gateway.engines]]`` and the engine records in etcd (``GATEWAY_TABLE``):
  an engine the gateway forwards requests to, with its tokenizer and its served adapters.

This module imports nothing heavy: the config loaders call it while validating a file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional
from urllib.parse import urlsplit

__all__ = ["EngineSpec", "ENGINE_ROLES", "MAX_ENGINES", "NODE_TABLE", "GATEWAY_TABLE", "parse_engine",
           "parse_engine_list"]

MAX_ENGINES = 1024                    # engines one table list may name
MAX_BLOCK_SIZE = 4096                 # tokens per KV block at most
ENGINE_ROLES = ("both", "prefill", "decode")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_ZMQ_RE = re.compile(r"^(tcp://\S+:[0-9]{1,5}|ipc://\S+|inproc://\S+)$")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine: vLLM, SGLang, the simulated engine, or a QuillCache node's residency events."""

    id: str
    model: str                        # the served (base) model name
    url: str = ""                     # HTTP base URL, e.g. http://127.0.0.1:8000 ("": events only)
    tokenizer: str = ""               # path of a local tokenizer.json; "" = approximate mode
    tokenizer_id: str = ""            # identity of the tokenizer; "" = the model name
    chat_template: str = ""           # path of a Jinja chat template; "" = the plain format
    adapters: tuple[str, ...] = ()    # LoRA adapters served under their own model names
    adapter: Optional[str] = None     # the adapter its KV events are indexed under (a node's router)
    tenant: str = ""                  # the tenant its KV events are indexed under (a node's router)
    role: str = "both"                # both, prefill or decode
    kv_events: str = ""               # ZMQ endpoint of its KV-event publisher
    kv_replay: str = ""               # ZMQ endpoint of its replay socket
    topic: str = ""                   # topic frame of its event messages
    pool: bool = False                # a QuillCache node's residency (pool credit), not an engine
    block_size: int = 16              # tokens per KV block (the engine's page size)

    @property
    def identity_tokenizer(self) -> str:
        return self.tokenizer_id or self.model


# table key -> EngineSpec field, and the keys a table must have
NODE_TABLE = {"id": "id", "endpoint": "kv_events", "replay_endpoint": "kv_replay", "model": "model",
              "tokenizer": "tokenizer_id", "tenant": "tenant", "adapter": "adapter", "pool": "pool",
              "topic": "topic"}
NODE_REQUIRED = frozenset({"id", "endpoint", "model", "tokenizer", "tenant"})
NODE_EXAMPLE = ('[[router.engines]] id = "vllm-0" endpoint = "tcp://127.0.0.1:5557" model = "llama" '
                'tokenizer = "llama" tenant = "acme"')
GATEWAY_TABLE = {k: k for k in ("id", "url", "model", "tokenizer", "tokenizer_id", "chat_template", "adapters",
                                "role", "kv_events", "kv_replay", "block_size")}
GATEWAY_REQUIRED = frozenset({"id", "url", "model"})
GATEWAY_EXAMPLE = '[[gateway.engines]] id = "e0" url = "http://127.0.0.1:8000" model = "llama-3-8b"'


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return value


def _id(key: str, value: Any) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{key} {value!r} must be 1-128 of A-Z a-z 0-9 _ . : -")
    return value


def _model(key: str, value: Any) -> str:
    if not _text(key, value):
        raise ValueError(f"{key} must not be empty")
    return value


def _url(key: str, value: Any) -> str:
    url = _text(key, value).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"{key} {value!r} must be http(s)://host:port")
    return url


def _zmq(key: str, value: Any) -> str:
    if _text(key, value) and not _ZMQ_RE.match(value):
        raise ValueError(f'{key} {value!r} is not a ZMQ endpoint (e.g. "tcp://127.0.0.1:5557")')
    return value


def _adapters(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
        raise ValueError(f"{key} must be a list of names")
    return tuple(value)


def _adapter(key: str, value: Any) -> Optional[str]:
    return _text(key, value) or None


def _role(key: str, value: Any) -> str:
    if value not in ENGINE_ROLES:
        raise ValueError(f"{key} {value!r} is not one of {', '.join(ENGINE_ROLES)}")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false")
    return value


def _block_size(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK_SIZE:
        raise ValueError(f"{key} must be an integer in 1..{MAX_BLOCK_SIZE}")
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "id": _id, "model": _model, "url": _url, "tokenizer": _text, "tokenizer_id": _text,
    "chat_template": _text, "adapters": _adapters, "adapter": _adapter, "tenant": _text, "role": _role,
    "kv_events": _zmq, "kv_replay": _zmq, "topic": _text, "pool": _flag, "block_size": _block_size,
}


def parse_engine(item: Any, where: str, table: Mapping[str, str], required: frozenset,
                 example: str, error: type[Exception] = ValueError) -> EngineSpec:
    """One engine table as an EngineSpec; raises ``error`` saying ``where`` what is wrong."""
    if not isinstance(item, dict):
        raise error(f"{where} is not a table (e.g. {example})")
    unknown = set(item) - set(table)
    if unknown:
        raise error(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(table))})")
    missing = required - set(item)
    if missing:
        raise error(f"{where}: missing {', '.join(sorted(missing))} (e.g. {example})")
    values = {}
    try:
        for key, value in item.items():
            values[table[key]] = _CHECKS[table[key]](key, value)
    except ValueError as exc:
        raise error(f"{where}: {exc}") from None
    spec = EngineSpec(**values)
    if spec.model in spec.adapters:
        raise error(f"{where}: adapter {spec.model!r} is also the base model name")
    if spec.kv_replay and not spec.kv_events:
        replay, events = (k for f in ("kv_replay", "kv_events") for k, v in table.items() if v == f)
        raise error(f"{where}: {replay} needs {events}")
    return spec


def parse_engine_list(value: Any, table: Mapping[str, str], required: frozenset, example: str,
                      error: type[Exception] = ValueError) -> tuple[EngineSpec, ...]:
    """A list of engine tables (at most ``MAX_ENGINES``, ids unique)."""
    if not isinstance(value, list):
        raise error(f"not a list of engines (e.g. {example})")
    if len(value) > MAX_ENGINES:
        raise error(f"{len(value)} engines: at most {MAX_ENGINES}")
    out, seen = [], set()
    for i, item in enumerate(value):
        spec = parse_engine(item, f"entry {i}", table, required, example, error)
        if spec.id in seen:
            raise error(f"entry {i}: engine {spec.id!r} is listed twice")
        seen.add(spec.id)
        out.append(spec)
    return tuple(out)
