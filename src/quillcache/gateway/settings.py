"""The gateway's settings: ``[gateway]``, ``[[gateway.engines]]``, ``[router]`` and ``[auth]``.

The same registry mechanism, TOML errors and exit codes as ``quillcached``
(quillcache.settings); ``[auth]`` and ``[router]`` are the node's own ``Setting`` objects,
so a tenant table or a router knob means the same thing in both files.  An engine table is
checked by ``control.engine_spec``, the node's ``[[router.engines]]`` validator too.
"""
from __future__ import annotations

from typing import Any, Optional

from quillcache.cluster.settings import CREDENTIAL_MIN_CHARS
from quillcache.control.engine_spec import (
    ENGINE_ROLES, GATEWAY_EXAMPLE, GATEWAY_REQUIRED, GATEWAY_TABLE, MAX_ENGINES, EngineSpec, parse_engine,
    parse_engine_list,
)
from quillcache.node.settings import SETTINGS, ConfigError, load_config
from quillcache.net import ConversionError, parse_hostport
from quillcache.settings.registry import Registry, Setting
from quillcache.settings.convert import boolean, int_range, string, parse_byte_size, parse_duration

__all__ = ["GATEWAY_REGISTRY", "EngineSpec", "ENGINE_ROLES", "load_gateway_config", "MAX_ENGINES",
           "engine_of_record", "engine_conflict", "ENGINE_KEYS"]

ENGINE_KEYS = frozenset(GATEWAY_TABLE)          # the keys of a [[gateway.engines]] table

def _engines(value: Any) -> tuple[EngineSpec, ...]:
    return parse_engine_list(value, GATEWAY_TABLE, GATEWAY_REQUIRED, GATEWAY_EXAMPLE, ConversionError)


def engine_of_record(record: Any, name: str) -> EngineSpec:
    """An engine registered in etcd under ``name``, validated exactly as a [[gateway.engines]]
    table; raises ConversionError naming what is wrong."""
    spec = parse_engine(record, f"engine record {name!r}", GATEWAY_TABLE, GATEWAY_REQUIRED, GATEWAY_EXAMPLE,
                        ConversionError)
    if spec.id != name:
        raise ConversionError(f"engine record {name!r}: its id is {spec.id!r}")
    return spec


_SHARED_PER_MODEL = ("tokenizer", "tokenizer_id", "chat_template", "block_size")


def engine_conflict(spec: EngineSpec, others) -> Optional[str]:
    """Why ``spec`` cannot serve beside ``others`` (the engines already known), or None.

    Engines of one model share a tokenizer, a chat template and a block size: the gateway
    hashes a prompt once, with the first engine's.  A model is served either by engines of
    role "both" or, disaggregated, by "prefill" and "decode" engines, never a mix.  An adapter
    name means one base model."""
    for other in others:
        if other.model == spec.model:
            for field in _SHARED_PER_MODEL:
                if getattr(spec, field) != getattr(other, field):
                    return (f"{field} {getattr(spec, field)!r} differs from engine {other.id}'s "
                            f"{getattr(other, field)!r}; engines of model {spec.model!r} must share it")
            if (spec.role == "both") != (other.role == "both"):
                return (f"role {spec.role!r} beside engine {other.id}'s {other.role!r}: a model is "
                        "served by engines of role \"both\" or by \"prefill\" and \"decode\" engines, "
                        "not a mix")
        names = {other.model, *other.adapters}
        for name in spec.adapters:
            if name in names and other.model != spec.model:
                return f"adapter {name!r} is engine {other.id}'s {'model' if name == other.model else 'adapter'} " \
                       f"of model {other.model!r}"
        if spec.model in other.adapters:
            return f"model {spec.model!r} is an adapter of engine {other.id}'s model {other.model!r}"
    return None


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
    "cluster": "Engines from etcd: with enabled = true the gateway also routes to the engines "
               "registered under /quillcache/<cluster_id>/engines/ (docs/gateway.md).",
}

_GATEWAY_SETTINGS: tuple[Setting, ...] = (
    Setting("gateway", "listen", parse_hostport, "127.0.0.1:8088", False,
            "Address of the tenants' HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
            "/health)."),
    Setting("gateway", "admin_listen", parse_hostport, "127.0.0.1:8089", False,
            "Address of the operator's endpoints (/metrics, /quillcache/workers, /quillcache/hot, "
            "/health), never served on listen: keep it where only operators reach it."),
    Setting("gateway", "max_connections", int_range(1, 1 << 20), 1024, False,
            "Client connections open at once on listen (the admin address has 64 of its own); past it "
            "a new connection is answered 503 and closed. The descriptor limit is raised to fit (2 per "
            "connection + 256), or this is lowered to fit it, with a warning."),
    Setting("gateway", "max_connections_per_peer", int_range(0, 1 << 20), 0, False,
            "Client connections one peer address may have open at once; past it, 503 and the close. "
            "0: no per-peer limit (the default: behind a proxy every client is the proxy's address)."),
    Setting("gateway", "client_header_timeout", _positive_duration, "15s", False,
            "A client connection that has sent no complete request head this long after it opened, "
            "or after its previous answer, is closed (aiohttp's keepalive_timeout): silent "
            "connections, slow headers and idle keep-alive connections."),
    Setting("gateway", "client_body_timeout", _positive_duration, "30s", True,
            "The whole request body must arrive within this; else 408 and the connection is closed."),
    Setting("gateway", "client_send_timeout", _positive_duration, "60s", True,
            "A client that takes none of its streamed answer for this long (it stopped reading) is "
            "dropped, and its upstream request with it."),
    Setting("gateway", "engines", _engines, [], False,
            "Upstream engines as [[gateway.engines]] tables: id, url, model, and optionally "
            "tokenizer (a local tokenizer.json), tokenizer_id, chat_template (a Jinja file), "
            "adapters (LoRA names served), role (both, prefill, decode), kv_events and kv_replay "
            "(ZMQ endpoints of the engine's KV-event publisher), block_size (tokens per KV block)."),
    Setting("gateway", "max_body", _body_size, "4MiB", False,
            "Largest request body; a larger one is refused with 413 before it is read."),
    Setting("gateway", "max_prompt_tokens", int_range(1, 1 << 24), 1 << 20, True,
            "Longest prompt in tokens (characters in approximate mode); longer ones get 400."),
    Setting("gateway", "queue_limit", int_range(1, 1 << 20), 256, True,
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
            "Time-to-first-token objective used by the goodput metric, and the SLO that [router] "
            "admission = \"predict\" holds each request to (refused above admission_k times it)."),
    Setting("gateway", "slo_tpot", _positive_duration, "80ms", True,
            "Time-per-output-token objective used by the goodput metric."),
    Setting("gateway", "name", string, "", False,
            "Name of this gateway in logs and metrics; empty means the host name."),
)


def _policy(value: Any) -> str:
    from quillcache.protocol.route import POLICIES
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
    if cfg.router.admission == "predict" and cfg.router.policy != "quillcache":
        raise ConfigError(f'{cfg.source}: [router] admission = "predict" with policy = "{cfg.router.policy}": '
                          'only policy "quillcache" predicts a time to first token (set admission = "off" '
                          'or policy = "quillcache")')
    seen: list[EngineSpec] = []
    for spec in cfg.gateway.engines:
        why = engine_conflict(spec, seen)
        if why is not None:
            raise ConfigError(f"{cfg.source}: [[gateway.engines]] {spec.id}: {why}")
        seen.append(spec)
    if cfg.cluster.enabled:
        if len(cfg.cluster.credential) < CREDENTIAL_MIN_CHARS:
            # Never the value itself, here or in any log line.
            raise ConfigError(f"{cfg.source}: [cluster] credential: needs at least {CREDENTIAL_MIN_CHARS} "
                              "characters when [cluster] enabled = true (the pool's credential: the "
                              "gateway routes only to engine records signed with it)")
        return                    # the missing half of a disaggregated model may register in etcd
    for model in sorted({s.model for s in seen}):
        roles = {s.role for s in seen if s.model == model}
        if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
            have = next(iter(roles))
            need = "decode" if have == "prefill" else "prefill"
            raise ConfigError(f"{cfg.source}: [[gateway.engines]] model {model!r} has {have} engines "
                              f"and no {need} engine: a disaggregated model needs both")


# [cluster]: the node's etcd, cluster_id and credential (one pool, one name, one secret); enabled
# means "watch the engines", and route only to those whose record is signed with the credential.
_CLUSTER = (Setting("cluster", "enabled", boolean, False, False,
                    "Also route to the engines registered in etcd (quillctl engine register, "
                    "quillcache-sim-engine --etcd), added and removed live, when their records are "
                    "signed with [cluster] credential; an id that is also in [[gateway.engines]] is "
                    "refused: the config's entry wins."),
            ) + tuple(s for s in SETTINGS if s.section == "cluster" and s.name in ("etcd", "cluster_id",
                                                                                 "credential"))

GATEWAY_REGISTRY = Registry("gateway", _GATEWAY_SECTIONS,
                            _GATEWAY_SETTINGS + (_ROUTER_POLICY,) + _shared("router") + _shared("auth")
                            + _CLUSTER, _check_gateway)


def load_gateway_config(path: Optional[str] = None, text: Optional[str] = None):
    """The gateway's validated config (from a file, TOML text, or the embedded defaults)."""
    return load_config(path, text, registry=GATEWAY_REGISTRY)
