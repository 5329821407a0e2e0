"""The node's settings: every section of ``quillcache.toml`` and the checks across sections.

This table drives validation of the node's config file, the sample config
(``conf/quillcache.toml``, ``quillctl config sample``) and the ``quillcache.toml(5)`` man
page, so the three never drift apart.  The framework is ``quillcache.settings``.
"""
from __future__ import annotations

from typing import Any

from quillcache._native.blocks import MAX_SIZE as MAX_BLOCK_LIMIT   # bytes: a block's size is a u32 field
from quillcache.cluster.settings import CLUSTER_SETTINGS, CLUSTER_SUMMARY, CREDENTIAL_MIN_CHARS
from quillcache.errors import ConfigError
from quillcache.exitcodes import CONFIG as EX_CONFIG  # the exit code of a bad config
from quillcache.net import CONGESTION_NAME, DEFAULT_ADDRESS, ConversionError, format_hostport, parse_hostport
from quillcache.settings import registry as _registry
from quillcache.settings.convert import (
    boolean, choice, format_byte_size, fraction, int_range,
    nonneg_float, parse_duration, positive_float, size_range, string, tenants,
)
from quillcache.settings.registry import Config, Registry, Setting

__all__ = ["SECTIONS", "SETTINGS", "NODE_REGISTRY", "Config", "ConfigError", "EX_CONFIG", "load_config",
           "parse_config", "render_sample", "DEFAULT_ADDRESS", "format_hostport", "parse_hostport"]


def router_module(value: Any) -> str:
    # The names come from the router-module registry (one place: quillcache.control.modules).
    from quillcache.control.modules import ROUTER_MODULES
    if isinstance(value, str) and value in ROUTER_MODULES:
        return value
    raise ConversionError("unknown router module; known: " + ", ".join(f'"{m}"' for m in ROUTER_MODULES))


def congestion(value: Any) -> str:
    # The kernel checks the name per socket (one it lacks is logged once and left alone).
    if isinstance(value, str) and (value == "" or CONGESTION_NAME.match(value)):
        return value
    raise ConversionError('not a TCP congestion control name (e.g. "reno", "cubic") or ""')


def engines(value: Any) -> tuple:
    # The fields and their checks live with the router module (quillcache.control.modules).
    from quillcache.control.modules import parse_engines
    return parse_engines(value, ConversionError)


SECTIONS = {
    "node": "This node: its name, where it listens and where it keeps its state.",
    "store": "The DRAM tier and the limits on blocks.",
    "ssd": "The SSD tier: a preallocated data file whose extents are placed by the offset allocator.",
    "wal": "The write-ahead log that makes SSD puts and the residency index durable.",
    "limits": "Protocol limits, enforced before anything is allocated.",
    "metrics": "The Prometheus /metrics endpoint.",
    "auth": "Tenants and their tokens. With no tenants the node runs open (dev mode).",
    "router": "The routing module hosted by this node: it consumes the engines' KV events and "
              "answers ROUTE requests (docs/protocol.md).",
    "events": "This node's own KV events: its residency changes published in vLLM's KV-event "
              "format (medium cpu, topic = node id), so routers see the pool as a tier.",
    "guard": "The identity guard: who may reuse a block.",
    "index": "The residency index: the store's record of which blocks are resident in which tier.",
    "cluster": CLUSTER_SUMMARY,
}

SETTINGS: tuple[Setting, ...] = (
    Setting("node", "id", string, "", False,
            "Name of this node in stats and logs; empty means the host name."),
    Setting("node", "listen", parse_hostport, DEFAULT_ADDRESS, False,
            "Address of the binary protocol (TCP)."),
    Setting("node", "unix_socket", string, "", False,
            "Path of the Unix-domain socket (same protocol, mode 0660; trusted clients map the DRAM "
            "arena through it, docs/shm.md); empty means <data_dir>/quillcached.sock, \"off\" none."),
    Setting("node", "shm", boolean, True, False,
            "Hand the DRAM arena to trusted clients of the Unix socket (tenants with shm = true, or "
            "everyone in open mode); false: the Unix socket copies like TCP."),
    Setting("node", "data_dir", string, "./var", False,
            "Directory for the SSD data file, the WAL and checkpoints."),
    Setting("node", "log_level", choice("debug", "info", "warning", "error"), "info", True,
            "Lowest level of the log lines written to stderr."),
    Setting("node", "drain_timeout", parse_duration, "10s", True,
            "How long SIGTERM waits for in-flight requests before closing connections."),
    Setting("node", "hello_timeout", parse_duration, "5s", True,
            "How long a new connection may take to log in (HELLO) when the node has tenants; then it "
            "is closed. Until then it may send nothing but HELLO, with a header of at most 8 KiB and no "
            "payload."),
    Setting("node", "idle_timeout", parse_duration, "300s", True,
            "Close a connection after this long without a byte from its client, when it holds nothing "
            "(no request in flight, no lease, no reserve) and did not map the arena; 0s: never."),
    Setting("node", "loopback_congestion", congestion, "reno", True,
            "TCP congestion control of a connection from this host (a loopback address, or the "
            "node's own). Loopback has no bottleneck: a pacing algorithm there (bbr) holds a reply "
            "back to its model's rate. Connections from other hosts keep the system's "
            "(net.ipv4.tcp_congestion_control); \"\" leaves same-host ones to it too."),
    Setting("store", "dram", size_range(1 << 20, 1 << 50), "1GiB", False,
            "Capacity of the DRAM arena (one anonymous mapping)."),
    Setting("store", "max_block", size_range(1, MAX_BLOCK_LIMIT), "64MiB", False,
            "Largest block accepted by a put (at most 2GiB); larger ones are refused before allocating."),
    Setting("store", "policy", choice("write_back", "write_through"), "write_back", True,
            "write_back: a put lands in DRAM and is demoted to SSD under pressure or by age; "
            "write_through: every put is acknowledged only after the SSD tier's durable publish."),
    Setting("store", "high_watermark", fraction, 0.9, True,
            "DRAM occupancy that starts demotion to SSD."),
    Setting("store", "low_watermark", fraction, 0.75, True,
            "DRAM occupancy that demotion brings the arena down to."),
    Setting("store", "demote_after", parse_duration, "0s", True,
            "Demote blocks older than this to SSD (0s: only under pressure)."),
    Setting("store", "lease", parse_duration, "10s", True,
            "How long a get holds a block against eviction and removal."),
    Setting("store", "put_timeout", parse_duration, "30s", True,
            "A started put that is not finished within this is aborted and its slot reclaimed."),
    Setting("store", "hugepages", boolean, False, False,
            "Ask for huge pages on the DRAM arena: 2 MiB hugetlb pages where enough are reserved "
            "(vm.nr_hugepages), else shmem transparent huge pages where the kernel's shmem_enabled "
            "allows them (advise, within_size or always); INFO's dram_backing says which."),
    Setting("store", "prefault", boolean, False, False,
            "Fault every page of the DRAM arena in at start (after the huge-page advice)."),
    Setting("ssd", "enabled", boolean, True, False,
            "Keep an SSD tier (a put with durable=true needs it)."),
    Setting("ssd", "path", string, "", False,
            "The SSD data file; empty means <data_dir>/ssd/blocks.dat."),
    Setting("ssd", "capacity", size_range(1 << 20, 1 << 50), "4GiB", False,
            "Size of the SSD data file (preallocated)."),
    Setting("ssd", "direct_io", boolean, True, False,
            "Write block bytes with O_DIRECT where the filesystem allows it."),
    Setting("ssd", "verify", choice("lazy", "eager"), "lazy", False,
            "When recovery checks each block's CRC32C: on its first read (lazy) or at start (eager)."),
    Setting("ssd", "promote_on_get", boolean, True, True,
            "A get of a block only on SSD copies it into DRAM when there is room; false: DRAM is left "
            "to puts and such gets are sent from the data file (sendfile, checked end to end by the "
            "stored CRC32C)."),
    Setting("ssd", "sendfile", boolean, True, False,
            "Send a GET served from the data file with sendfile(2); false: preadv into a buffer, then "
            "write (for filesystems whose sendfile is slow or missing). Used only while the tier writes "
            "with O_DIRECT (direct_io): a buffered write into a reused extent would change the pages of "
            "a reply still unread in a socket."),
    Setting("wal", "sync", choice("group", "always"), "group", False,
            "group: one vectored write and one fsync per commit window; always: one per record."),
    Setting("wal", "commit_window", parse_duration, "1ms", True,
            "How long group commit gathers records before one write + fsync."),
    Setting("wal", "segment_size", size_range(1 << 20, 1 << 34), "64MiB", False,
            "Size at which the log rotates to a new segment file."),
    Setting("wal", "backend", choice("auto", "io_uring", "pwritev"), "auto", False,
            "auto uses io_uring where the kernel allows it, else pwritev + fdatasync."),
    Setting("wal", "checkpoint_interval", parse_duration, "60s", True,
            "How often the residency index is checkpointed and the log truncated."),
    Setting("index", "persistent", boolean, False, False,
            "Keep the residency index in a write-ahead log and checkpoints under <data_dir>/index, "
            "so a restart finds its records without rebuilding them; at start it is checked against "
            "the SSD tier, whose data wins where they disagree."),
    Setting("limits", "max_header", size_range(64, 1 << 24), "64KiB", False,
            "Largest frame header (keys and batch descriptors)."),
    Setting("limits", "max_payload", size_range(1, 1 << 40), "1GiB", False,
            "Largest frame payload (a batch of blocks)."),
    Setting("limits", "max_batch", int_range(1, 1 << 16), 1024, False,
            "Most keys in one GET_MANY, PUT_MANY or EXISTS."),
    Setting("limits", "max_inflight", int_range(1, 1 << 16), 256, False,
            "Most requests in flight on one connection."),
    Setting("limits", "max_connections", int_range(1, 1 << 20), 4096, False,
            "Most client connections at once."),
    Setting("limits", "max_unauthenticated", int_range(1, 1 << 20), 1024, False,
            "Most connections that have not logged in yet (HELLO), from all sources together, and at "
            "most half of max_connections: logged-in clients keep the other slots. A newer connection "
            "pushes the oldest one still waiting out, so bare connections cannot keep a client with a "
            "valid token from logging in."),
    Setting("limits", "max_unauthenticated_per_source", int_range(1, 1 << 20), 32, False,
            "Most connections waiting to log in from one source (an IP address; on the Unix socket a "
            "process, by SO_PEERCRED uid and pid); a newer one from it pushes out its own oldest, "
            "never another source's."),
    Setting("metrics", "enabled", boolean, True, False,
            "Serve Prometheus metrics."),
    Setting("metrics", "listen", parse_hostport, "127.0.0.1:7471", False,
            "Address of the /metrics HTTP endpoint."),
    Setting("auth", "tenants", tenants, [], True,
            "Tenants as [[auth.tenants]] tables with name and token (a hash: quillctl auth hash-token), "
            "and shm = true where that tenant's Unix-socket clients may map the DRAM arena; "
            "may_act_for = [\"*\"] (or a list of names) lets that principal (an engine) name those tenants "
            "in its keys; pin_bytes (e.g. \"1GiB\") is the most its keys' hard pins may hold, and a tenant "
            "without it gets an even share of the hard-pin budget that the others' pin_bytes leave "
            "(docs/tiering.md)."),
    Setting("auth", "max_failed_hellos", int_range(1, 1 << 20), 10, True,
            "Failed HELLOs in a row from one source (an IP address; on the Unix socket a uid and pid) "
            "after which each further failed HELLO also closes its connection. Every failed HELLO is "
            "answered late, 50 ms doubled per failure in a row up to 5 s (a minute without a failure "
            "ends the row); a valid token is never refused or delayed."),
    Setting("router", "module", router_module, "none", False,
            "Routing module hosted by this node: none (a plain store node), dynamo (Dynamo's cost "
            "function as shipped, identity-blind) or quillcache (identity-scoped credit plus pool credit)."),
    Setting("router", "engines", engines, [], False,
            "The engines to route to, as [[router.engines]] tables: id, endpoint (their ZMQ KV-event "
            "PUB socket), replay_endpoint, model, tokenizer, tenant, adapter; pool = true marks a "
            "QuillCache node's residency publisher (its blocks count as the pool tier)."),
    Setting("router", "block_size", int_range(1, 1 << 16), 16, False,
            "Tokens per block of the router's own hash chain (the engines' block size)."),
    Setting("router", "prefill_load_scale", nonneg_float, 1.0, False,
            "Weight of the prefill blocks a worker would still compute (Dynamo's prefill_load_scale)."),
    Setting("router", "active_request_weight", nonneg_float, 0.0, False,
            "Cost per active request (Dynamo's decode_active_request_weight)."),
    Setting("router", "host_weight", nonneg_float, 0.75, False,
            "Credit per overlap block in the worker's host (CPU) cache; a device block earns 1.0."),
    Setting("router", "disk_weight", nonneg_float, 0.25, False,
            "Credit per overlap block in the worker's disk cache."),
    Setting("router", "pool_weight", nonneg_float, 0.5, False,
            "Credit per block any worker can fetch from the QuillCache pool (module quillcache only)."),
    Setting("router", "kv_blocks", int_range(0, 1 << 40), 0, False,
            "KV pages (of the engines' block_size tokens) each engine holds: vLLM's num_gpu_blocks, "
            "SGLang's max_total_num_tokens / page_size. With it, policy quillcache predicts the wait "
            "for pages on an engine whose KV memory is full, and counts as evictions only the pages a "
            "request takes past those free there (docs/router.md); 0: not known (the gateway asks its "
            "engines, see learn_kv_blocks), no wait predicted and every page taken counts as an "
            "eviction. One figure for every engine of a model."),
    Setting("router", "learn_kv_blocks", boolean, True, False,
            "With kv_blocks = 0, the gateway asks each engine how much KV it holds (vLLM's /metrics "
            "vllm:cache_config_info, num_gpu_blocks x block_size; SGLang's /server_info "
            "max_total_num_tokens) and uses the smallest figure among a model's engines as its "
            "kv_blocks; false: without kv_blocks the memory terms stay off. A node's hosted router, "
            "whose engines are event streams only, learns nothing."),
    Setting("router", "temperature", nonneg_float, 0.0, False,
            "0: the cheapest worker, ties broken at random; > 0: softmax sampling over the costs."),
    Setting("router", "approximate", boolean, False, False,
            "Predict residency from routing decisions, for engines that publish no KV events."),
    Setting("router", "approx_ttl", parse_duration, "120s", False,
            "How long a predicted block is believed in approximate mode."),
    Setting("router", "admission", choice("off", "predict"), "off", False,
            "predict: policy quillcache refuses a request whose predicted time to first token exceeds "
            "admission_k times its TTFT SLO (the gateway answers 429 with Retry-After); off: admit all."),
    Setting("router", "admission_k", positive_float, 1.0, False,
            "With admission = \"predict\": refuse above this multiple of the TTFT SLO."),
    Setting("events", "publish", boolean, False, False,
            "Publish this node's residency changes (block stored, block removed)."),
    Setting("events", "endpoint", string, "tcp://127.0.0.1:7480", False,
            "ZMQ PUB endpoint the residency events are published on."),
    Setting("events", "replay_endpoint", string, "tcp://127.0.0.1:7481", False,
            "ZMQ ROUTER endpoint that replays missed batches (empty: no replay)."),
    Setting("events", "buffer_steps", int_range(1, 1 << 22), 10000, False,
            "Batches kept for replay."),
    Setting("guard", "mode", choice("strict", "tenant", "off"), "strict", True,
            "strict: serve only an exact model, tokenizer, adapter and tenant match; tenant: tenant "
            "isolation only; off: content-hash reuse (for studies; logged loudly)."),
    *CLUSTER_SETTINGS,
)


def _check_node(cfg: "Config") -> None:
    store = cfg.store
    if store.low_watermark >= store.high_watermark:
        raise ConfigError(
            f"{cfg.source}: [store] low_watermark = {store.low_watermark}: must be below "
            f"high_watermark = {store.high_watermark} (e.g. 0.75 and 0.9)")
    if store.max_block > store.dram:
        raise ConfigError(
            f"{cfg.source}: [store] max_block = \"{format_byte_size(store.max_block)}\": larger "
            f"than [store] dram = \"{format_byte_size(store.dram)}\" (e.g. \"64MiB\")")
    if cfg.node.hello_timeout <= 0:
        raise ConfigError(f'{cfg.source}: [node] hello_timeout = "{cfg.node.hello_timeout:g}s": must be above 0 '
                          '(e.g. "5s")')
    cluster = cfg.cluster
    if cluster.enabled and len(cluster.credential) < CREDENTIAL_MIN_CHARS:
        raise ConfigError(
            f"{cfg.source}: [cluster] credential: needs at least {CREDENTIAL_MIN_CHARS} characters when "
            "[cluster] enabled = true (the pool's keys are derived from it)")
    if cluster.enabled:
        for section, name in (("cluster", "node_id"), ("node", "id")):
            value = getattr(getattr(cfg, section), name)
            if "@" in value:
                # a home names other nodes' records "<node>@<epoch>" beside its own (cluster/records.py)
                raise ConfigError(f'{cfg.source}: [{section}] {name} = "{value}": no "@" in a node id '
                                  "when [cluster] enabled = true")


NODE_REGISTRY = Registry("quillcached", SECTIONS, SETTINGS, _check_node, title="node")


def parse_config(raw, source: str = "quillcache.toml", registry: Registry = NODE_REGISTRY) -> Config:
    """Validate a parsed TOML document; raises ConfigError naming source, section, key, value."""
    return _registry.parse_config(raw, source, registry)


def load_config(path: str | None = None, text: str | None = None, source: str | None = None,
                registry: Registry = NODE_REGISTRY) -> Config:
    """The node's config from a file path, from TOML text, or (neither) the embedded defaults."""
    return _registry.load_config(path, text, source, registry=registry)


def render_sample(registry: Registry = NODE_REGISTRY) -> str:
    """The full default configuration, commented from the registry's help text."""
    return _registry.render_sample(registry)
