"""The registry of router modules a node can host (``[router] module``), and the
``[[router.engines]]`` tables (``EngineSpec``, checked by ``control.engine_spec``).

A module is a name mapped to a factory ``(router_config_kwargs) -> RouterConfig`` policy
name; ``none`` hosts nothing.  This module imports nothing heavy: the config loader asks it
for the names while validating a file.
"""
from __future__ import annotations

from typing import Any, Optional

from quillcache.control.engine_spec import NODE_EXAMPLE, NODE_REQUIRED, NODE_TABLE, EngineSpec, parse_engine_list
from quillcache.protocol.route import POLICIES

__all__ = ["ROUTER_MODULES", "POLICIES", "EngineSpec", "parse_engines", "module_policy"]

# name -> the router policy it runs (None: no router)
ROUTER_MODULES: dict[str, Optional[str]] = {
    "none": None,
    "dynamo": "dynamo",          # Dynamo's cost function as shipped: identity-blind, no pool
    "quillcache": "quillcache",  # identity-scoped credit plus pool credit
}

def module_policy(name: str) -> Optional[str]:
    """The router policy of a module name; ``KeyError`` names the known modules."""
    try:
        return ROUTER_MODULES[name]
    except KeyError:
        raise KeyError(f"unknown router module {name!r}; known: {', '.join(ROUTER_MODULES)}") from None


def parse_engines(value: Any, error: type[Exception] = ValueError) -> tuple[EngineSpec, ...]:
    """A node's ``[[router.engines]]`` tables (``control.engine_spec.NODE_TABLE``)."""
    return parse_engine_list(value, NODE_TABLE, NODE_REQUIRED, NODE_EXAMPLE, error)
