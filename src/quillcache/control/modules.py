"""The registry of router modules a node can host (``[router] module``), and the
``[[router.engines]]`` table format.

A module is a name mapped to a factory ``(router_config_kwargs) -> RouterConfig`` policy
name; ``none`` hosts nothing.  This module imports nothing heavy: the config loader asks it
for the names while validating a file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from quillcache.protocol.route import POLICIES

__all__ = ["ROUTER_MODULES", "POLICIES", "EngineSpec", "parse_engines", "module_policy"]

# name -> the router policy it runs (None: no router)
ROUTER_MODULES: dict[str, Optional[str]] = {
    "none": None,
    "dynamo": "dynamo",          # Dynamo's cost function as shipped: identity-blind, no pool
    "quillcache": "quillcache",  # identity-scoped credit plus pool credit
}

_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_ENDPOINT_RE = re.compile(r"^(tcp://[^\s]+:[0-9]{1,5}|ipc://[^\s]+|inproc://[^\s]+)$")
_FIELDS = {"id", "endpoint", "replay_endpoint", "model", "tokenizer", "tenant", "adapter", "pool", "topic"}
_REQUIRED = {"id", "endpoint", "model", "tokenizer", "tenant"}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    id: str
    endpoint: str
    model: str
    tokenizer: str
    tenant: str
    replay_endpoint: Optional[str] = None
    adapter: Optional[str] = None
    pool: bool = False
    topic: str = ""


def module_policy(name: str) -> Optional[str]:
    """The router policy of a module name; ``KeyError`` names the known modules."""
    try:
        return ROUTER_MODULES[name]
    except KeyError:
        raise KeyError(f"unknown router module {name!r}; known: {', '.join(ROUTER_MODULES)}") from None


def parse_engines(value: Any, error: type[Exception] = ValueError) -> tuple[EngineSpec, ...]:
    example = ('[[router.engines]] id = "vllm-0" endpoint = "tcp://127.0.0.1:5557" '
               'model = "llama" tokenizer = "llama" tenant = "acme"')
    if not isinstance(value, list):
        raise error(f"not a list of engines (e.g. {example})")
    out, seen = [], set()
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise error(f"entry {i}: not a table (e.g. {example})")
        unknown = set(item) - _FIELDS
        if unknown:
            raise error(f"entry {i}: unknown field(s) {', '.join(sorted(unknown))} "
                        f"(known: {', '.join(sorted(_FIELDS))})")
        missing = _REQUIRED - set(item)
        if missing:
            raise error(f"entry {i}: missing {', '.join(sorted(missing))} (e.g. {example})")
        for name in ("id", "endpoint", "model", "tokenizer", "tenant", "replay_endpoint", "adapter", "topic"):
            if name in item and not isinstance(item[name], str):
                raise error(f"entry {i}: {name} must be a string")
        if not _ID_RE.match(item["id"]):
            raise error(f"entry {i}: id {item['id']!r} must be 1-128 of A-Z a-z 0-9 _ . : -")
        for name in ("endpoint", "replay_endpoint"):
            if item.get(name) and not _ENDPOINT_RE.match(item[name]):
                raise error(f"entry {i}: {name} {item[name]!r} is not a ZMQ endpoint "
                            '(e.g. "tcp://127.0.0.1:5557")')
        if "pool" in item and not isinstance(item["pool"], bool):
            raise error(f"entry {i}: pool must be true or false")
        if item["id"] in seen:
            raise error(f"entry {i}: engine id {item['id']!r} is listed twice")
        seen.add(item["id"])
        out.append(EngineSpec(item["id"], item["endpoint"], item["model"], item["tokenizer"],
                              item["tenant"], item.get("replay_endpoint") or None,
                              item.get("adapter") or None, item.get("pool", False),
                              item.get("topic", "")))
    return tuple(out)
