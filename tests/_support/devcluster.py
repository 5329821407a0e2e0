"""``make cluster``: etcd and three quillcached nodes on loopback, for a newcomer to try.

    make cluster            # Ctrl-C stops everything
    quillctl --addr 127.0.0.1:<port of node-a> cluster
    quillctl --addr ... put -m demo -p p0 -b b0 FILE   (on one node)
    quillctl --addr ... get -m demo -p p0 -b b0        (on another)

State (configs, logs, the etcd data dir) lives under ./var/cluster and is removed on exit.
"""
from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

from quillcache import Client
from tests._support.cluster import CREDENTIAL, Pool
from tests._support.etcd import EtcdServer


def _transport(pool: Pool, d, timeout: float = 10.0) -> str:
    """The node's [cluster] transport once ``auto`` settled (NIXL's agent is made in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        with Client(d.addr, token=CREDENTIAL) as c:
            info = c.info("cluster")["Cluster"]
        if info["transport_transport"] == "nixl" or "transport auto -> tcp" in d.log() \
                or time.monotonic() > deadline:
            extra = f" (UCX_TLS {info['transport_ucx_tls']})" if info["transport_transport"] == "nixl" else ""
            return info["transport_transport"] + extra
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 3
    root = Path("var/cluster").resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with EtcdServer(root / "etcd") as etcd:
        with Pool(root, etcd.endpoint, n, lease_ttl="3s", dram="512MiB", cluster_id="dev") as pool:
            pool.wait_members(n, timeout=30)
            print(f"etcd      {etcd.endpoint}")
            for node_id, d in pool.nodes.items():
                print(f"{node_id:9} {d.addr}   transport {_transport(pool, d)}   config {d.config}   log {d.log_path}")
            a = next(iter(pool.nodes.values())).addr
            print(f"\ntry:  .venv/bin/quillctl --addr {a} cluster")
            print(f"      echo hello > /tmp/b; .venv/bin/quillctl --addr {a} put -m demo -p p0 -b b0 /tmp/b")
            for d in list(pool.nodes.values())[1:]:
                print(f"      .venv/bin/quillctl --addr {d.addr} get -m demo -p p0 -b b0")
            print(f"      .venv/bin/quillctl --addr {a} locate -m demo -p p0 -b b0")
            print(f"(node-to-node credential: {CREDENTIAL}; Ctrl-C stops the pool)", flush=True)
            try:
                while not stop:
                    time.sleep(0.5)
                    for node_id, d in pool.nodes.items():
                        if d.proc.poll() is not None:
                            print(f"{node_id} exited ({d.proc.returncode}); see {d.log_path}")
                            return 1
            except KeyboardInterrupt:
                pass
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
