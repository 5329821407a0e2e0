"""The ``[cluster]`` section: one table read by the node, the gateway (etcd, cluster_id) and the
engines' registrants (``quillctl engine register``, ``quillcache-sim-engine``), so each option
means the same thing everywhere."""
from __future__ import annotations

from quillcache.settings.convert import (
    advertise, boolean, choice, duration_range, endpoints, ident, int_range, size_range, string,
)
from quillcache.settings.registry import Setting

__all__ = ["CLUSTER_SETTINGS", "CLUSTER_SUMMARY", "CLUSTER_BY_NAME", "CREDENTIAL_MIN_CHARS", "CREDENTIAL_ENV"]

CREDENTIAL_MIN_CHARS = 16       # characters of a [cluster] credential at least
CREDENTIAL_ENV = "QUILLCACHE_CLUSTER_CREDENTIAL"   # the registrants' environment variable for it

CLUSTER_SUMMARY = "A pool of nodes: membership on etcd, residency by rendezvous hashing, cross-node fetch."

CLUSTER_SETTINGS: tuple[Setting, ...] = (
    Setting("cluster", "enabled", boolean, False, False,
            "Join a pool of nodes; false: a single node with no etcd and no peers."),
    Setting("cluster", "etcd", endpoints, ["127.0.0.1:2379"], False,
            "The etcd endpoints that hold the membership: host:port, http://host:port or host (port 2379)."),
    Setting("cluster", "cluster_id", ident, "quillcache", False,
            "Name of the pool: nodes with the same etcd and cluster_id see each other."),
    Setting("cluster", "node_id", string, "", False,
            "This node's name in the pool; empty means [node] id, else the host name."),
    Setting("cluster", "advertise", advertise, "", False,
            "host:port that peers dial to reach this node; empty means [node] listen."),
    Setting("cluster", "lease_ttl", duration_range(1.0, 60.0), "3s", False,
            "TTL of the etcd lease under this node's record (kept alive every TTL/3); a dead node "
            "leaves the view within this."),
    Setting("cluster", "hop_timeout", duration_range(0.01, 30.0), "1s", False,
            "Deadline of one node-to-node request (locate, fetch, announce)."),
    Setting("cluster", "replicas", int_range(1, 16), 1, False,
            "Copies of each put block: the first where placement says, the others on the next "
            "nodes in rendezvous order."),
    Setting("cluster", "placement", choice("local", "hashed"), "local", False,
            "local: the node a client writes to keeps the first copy (no hop on the put path); "
            "hashed: the first copy also goes to the key's first node in rendezvous order."),
    Setting("cluster", "cache_remote", boolean, True, False,
            "Keep a local copy of a block fetched from another node."),
    Setting("cluster", "credential", string, "", False,
            "The pool's shared secret (at least 16 characters; required when enabled), never sent "
            "nor logged: keys derived from it log the nodes in to each other and sign member and "
            "engine records in etcd (a gateway refuses an engine record it does not sign)."),
    Setting("cluster", "reannounce_rate", int_range(1, 1 << 24), 20000, False,
            "Records per second a node re-announces to their new homes after a membership change."),
    # the NIXL transport (transfer/nixl_transport.py, cluster/grants.py, docs/nixl.md)
    Setting("cluster", "transport", choice("auto", "tcp", "nixl"), "auto", False,
            "How blocks cross between nodes: nixl (one-sided reads from the holder's arena; exits 78 "
            "if NIXL cannot load), tcp (FETCH), auto (nixl where it loads and the holder has it, else tcp)."),
    Setting("cluster", "grant_ttl", duration_range(0.001, 30.0), "1s", False,
            "How long a holder keeps a block granted to a NIXL reader in place (at most [store] lease); "
            "a read not done by then is a miss."),
    Setting("cluster", "grant_reuse", duration_range(0.0, 30.0), "500ms", False,
            "How long a NIXL reader reads a granted block again without asking its holder (at most half "
            "of the holder's grant_ttl; the block stays in place that long, and a read within it returns "
            "the block as granted even if the holder replaced it since); 0: one GRANT per read."),
    Setting("cluster", "nixl_staging", size_range(1 << 20, 1 << 40), "64MiB", False,
            "Registered memory that this node's NIXL reads land in before they are checked."),
)

CLUSTER_BY_NAME = {s.name: s for s in CLUSTER_SETTINGS}
