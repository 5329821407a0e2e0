"""The connectors' settings: one table per engine, one parser, the token read once.

Each engine hands its connector a dict (vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config``, LMCache's ``remote_storage_plugin.<name>.*`` keys
of ``extra_config``).  ``parse`` converts every known key, refuses a bad value with the setting's
name and what a good one looks like, and returns the keys it does not know, so a typo
(``adress``) is reported instead of silently leaving the default in place.  ``tests/connectors/
test_engines_doc.py`` runs every configuration block of docs/engines.md through these tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from quillcache.client.calls import DEFAULT_SPIN_US, MAX_SPIN_US

__all__ = ["Setting", "COMMON", "VLLM", "SGLANG", "SGLANG_OWN", "LMCACHE", "LMCACHE_OWN", "parse",
           "read_token", "resolve_token", "SettingError"]


class SettingError(ValueError):
    """A connector setting with a value it cannot use; the message names the setting."""


def _string(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("not a string")
    return v


def _opt_string(v: Any) -> Optional[str]:
    return None if v is None or v == "" else _string(v)


def _number(v: Any, what: str) -> float:
    """``v`` as a float (a bool is not a number here); ``what`` names it in the error."""
    if not isinstance(v, bool):
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"not a number of {what}")


def _positive_float(v: Any) -> float:
    f = _number(v, "seconds (e.g. 5)")
    if not f > 0:
        raise ValueError("must be greater than 0")
    return f


def _count(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("not a whole number (e.g. 16)")
    try:
        i = int(v)
    except (TypeError, ValueError):
        raise ValueError("not a whole number (e.g. 16)") from None
    if i < 0 or (isinstance(v, float) and v != i):
        raise ValueError("not a whole number >= 0 (e.g. 16)")
    return i


def _flag(v: Any) -> bool:
    if isinstance(v, bool) or v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.lower() in ("true", "1", "yes")
    raise ValueError("not a boolean (true or false)")


def _spin_us(v: Any) -> float:
    f = _number(v, "microseconds (e.g. 100)")
    if not 0 <= f <= MAX_SPIN_US:
        raise ValueError(f"must be 0 to {MAX_SPIN_US:g}")
    return f


def _kv_dtype(v: Any) -> str:
    from quillcache.connectors.kvquant import KV_DTYPES
    if v is None or v == "":
        return "auto"
    if v not in KV_DTYPES:
        raise ValueError(f"not one of {', '.join(KV_DTYPES)}")
    return v


def _load_path(v: Any) -> str:
    from quillcache.connectors.paged import LOAD_PATHS
    if v not in LOAD_PATHS:
        raise ValueError(f"not one of {', '.join(LOAD_PATHS)}")
    return v


@dataclass(frozen=True)
class Setting:
    name: str
    convert: Callable[[Any], Any]
    default: Any
    help: str


COMMON = (
    Setting("address", _opt_string, None,
            "the node: unix:/path/quillcached.sock (maps the arena) or host:port; unset: the node's "
            "default Unix socket (/run/quillcache/quillcached.sock), then 127.0.0.1:7470"),
    Setting("token", _opt_string, None, "the engine tenant's token ([[auth.tenants]]); never logged"),
    Setting("token_file", _opt_string, None, "a file holding the token (read once, at start)"),
    Setting("timeout_s", _positive_float, 5.0, "seconds: connect and every wait on the node"),
    Setting("spin_us", _spin_us, DEFAULT_SPIN_US, "microseconds a receive polls before its thread sleeps (0: sleeps "
            "at once; docs/protocol.md, \"Busy-polling receives\")"),
    Setting("model", _opt_string, None, "the model name in every key (default: the engine's)"),
    Setting("tokenizer_id", _opt_string, None, "the tokenizer id in every key (default: the engine's)"),
    Setting("tenant", _string, "", "the engine's default tenant"),
)
VLLM = COMMON + (
    Setting("dtype", _opt_string, None, "the KV dtype in the scope (default: the cache's)"),
    Setting("kv_dtype", _kv_dtype, "auto", "what the pool stores: auto (the cache's dtype) or fp8_e4m3 "
            "(a float32 scale per block, layer and K/V; named in the scope instead of dtype)"),
    Setting("block_size", _count, 0, "tokens per block (default: the engine's)"),
    Setting("num_layers", _count, 0, "layers in the scope (default: the model's)"),
    Setting("layout", _string, "vllm-2nbhd", "the layout name in the scope"),
    Setting("events", _flag, False, "publish stored blocks through take_events"),
    Setting("events_medium", _string, "STORAGE", "the medium of those events"),
    Setting("load_path", _load_path, "layered", "layered: loads copy layer by layer straight out of the mapped "
            "arena, so layer L computes while later layers copy; staged: whole blocks through a device buffer"),
)
SGLANG = COMMON + (
    Setting("dtype", _string, "auto", "the KV dtype in the scope (replaced by the host pool's)"),
    Setting("page_size", _count, 0, "tokens per page (replaced by the host pool's)"),
    Setting("num_layers", _count, 0, "layers in the scope (replaced by the host pool's)"),
)
# keys of the same JSON that SGLang itself reads (the dynamic backend's loader, the v1 switch)
SGLANG_OWN = ("backend_name", "module_path", "class_name", "interface_v1")
LMCACHE = tuple(s for s in COMMON if s.name != "model") + (
    Setting("adapter", _opt_string, None, "the adapter id when the key has no quillcache_adapter tag"),
    Setting("layout", _string, "lmcache", "the layout name in the scope"),
    Setting("num_layers", _count, 0, "layers in the scope"),
)
# remote_storage_plugin.<name>.* keys that LMCache itself reads (DynamicConnectorAdapter)
LMCACHE_OWN = ("module_path", "class_name")


def parse(table: tuple[Setting, ...], raw: dict, where: str, own: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Every setting of ``table`` (its default when absent) and the keys neither the table nor
    the engine (``own``) knows.  A bad value raises SettingError naming ``where`` and the key."""
    if not isinstance(raw, dict):
        raise SettingError(f"{where}: expected a JSON object of settings, got {type(raw).__name__}")
    out = {}
    for s in table:
        if s.name in raw and raw[s.name] is not None:
            try:
                out[s.name] = s.convert(raw[s.name])
            except ValueError as exc:
                raise SettingError(f"{where}: {s.name} = {raw[s.name]!r}: {exc}") from None
        else:
            out[s.name] = s.default
    if out.get("token") and out.get("token_file"):
        raise SettingError(f"{where}: token and token_file are both set: give one")
    known = {s.name for s in table} | set(own)
    return out, sorted(k for k in raw if k not in known)


def read_token(path: str, where: str) -> str:
    """The token in ``path`` (one line; surrounding whitespace dropped), read once."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise SettingError(f"{where}: token_file {path!r}: {exc.strerror or exc}") from None
    if not text:
        raise SettingError(f"{where}: token_file {path!r} is empty")
    return text


def resolve_token(values: dict, where: str) -> Optional[str]:
    """The token from ``token`` or ``token_file`` (None: connect without one, open mode)."""
    if values.get("token_file"):
        return read_token(values["token_file"], where)
    return values.get("token") or None
