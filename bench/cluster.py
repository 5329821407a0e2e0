"""The pool's figures, each with its baseline measured in the same run (issue 14).

    .venv/bin/python bench/cluster.py [--rounds 8] [--detect-trials 3]

Starts a real etcd and three real quillcached nodes on loopback (cache_remote = false, so
every cross-node GET crosses), then measures:

* cross-node GET (client -> B, B fetches from A) against local GET (client -> A) of the
  same blocks, 4 MiB and 256 KiB, one client, rounds interleaved; target >= 0.5x;
* LOCATE of a batch of 64 keys at their home (the request a missing node sends), p50
  and p99, against a PING round trip on the same kind of connection; target p50 <= 0.2 ms;
* failure detection: kill -9 of a node until the others' views drop it, with the
  default lease_ttl (3 s); target <= 3 s (Mooncake's stale window: 10-12 s).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quillcache import Client  # noqa: E402
from quillcache.cluster import wire  # noqa: E402
from quillcache.cluster.hrw import Ring, key_hash  # noqa: E402
from quillcache.model import KvBlockKey, encode_key  # noqa: E402
from quillcache.protocol.opcodes import Opcode  # noqa: E402
from tests._support.cluster import CREDENTIAL, Pool, cluster_view  # noqa: E402
from tests._support.etcd import EtcdServer  # noqa: E402


def key(i: int, tag: str) -> KvBlockKey:
    return KvBlockKey("bench", "tok", None, "t0", f"{tag}-p{i // 16}", f"{tag}-b{i}")


def throughput(client: Client, keys, size: int, check: bytes) -> float:
    t0 = time.perf_counter()
    for k in keys:
        data = client.get(k)
        if len(data) != size or data[:len(check)] != check:
            raise SystemExit("wrong bytes")
    return len(keys) * size / (time.perf_counter() - t0)


def bench_get(pool: Pool, size: int, count: int, rounds: int) -> tuple[float, float]:
    tag = f"g{size}"
    payload = os.urandom(size)
    keys = [key(i, tag) for i in range(count)]
    with Client(pool["a"].addr, timeout=30) as a:
        for k in keys:
            a.put(k, payload)
    time.sleep(0.2)                          # the records reach their homes
    local, remote = [], []
    with Client(pool["a"].addr, timeout=30) as a, Client(pool["b"].addr, timeout=30) as b:
        throughput(a, keys, size, payload[:64])          # warm: connections, page cache
        throughput(b, keys, size, payload[:64])
        for _ in range(rounds):
            local.append(throughput(a, keys, size, payload[:64]))
            remote.append(throughput(b, keys, size, payload[:64]))
    return statistics.median(local), statistics.median(remote)


def bench_locate(pool: Pool, samples: int) -> tuple[float, float, float]:
    members = sorted(m["node_id"] for m in cluster_view(pool["a"].addr)["members"] if m["state"] == "up")
    ring = Ring(members)
    keys = []
    i = 0
    while len(keys) < 64:                    # 64 keys whose home is node-a: one LOCATE, one home
        k = key(i, "loc")
        if ring.home(key_hash(encode_key(k))) == "node-a":
            keys.append(k)
        i += 1
    with Client(pool["b"].addr) as b:
        b.put_many([(k, b"x" * 64) for k in keys])
    time.sleep(0.2)
    body = wire.encode_locate([encode_key(k) for k in keys], wire_limits := None or Client(pool["a"].addr,
                                                                                       token=CREDENTIAL).limits)
    lat, ping = [], []
    with Client(pool["a"].addr, token=CREDENTIAL) as peer:
        found = wire.decode_locate_reply(peer.call(Opcode.LOCATE, body).header, wire_limits)
        if sum(1 for holders in found if holders) != 64:
            raise SystemExit(f"LOCATE found {sum(1 for h in found if h)} of 64 keys")
        for _ in range(200):
            peer.call(Opcode.LOCATE, body)
            peer.ping()
        for _ in range(samples):
            t0 = time.perf_counter()
            peer.call(Opcode.LOCATE, body)
            lat.append(time.perf_counter() - t0)
            ping.append(peer.ping())
    lat.sort()
    return statistics.median(lat), lat[int(len(lat) * 0.99)], statistics.median(ping)


def bench_detect(pool: Pool, trials: int) -> list[float]:
    out = []
    for t in range(trials):
        victim = pool.add(f"x{t}")
        pool.wait_members(4, timeout=30)
        victim.send(signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            ids = {m["node_id"] for m in cluster_view(pool["b"].addr)["members"] if m["state"] == "up"}
            if f"node-x{t}" not in ids:
                break
            time.sleep(0.01)
        out.append(time.monotonic() - t0)
        victim.wait(5)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--locate-samples", type=int, default=3000)
    ap.add_argument("--detect-trials", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="qc-bench-cluster-"))
    with EtcdServer(tmp / "etcd") as etcd, \
            Pool(tmp, etcd.endpoint, 3, lease_ttl="3s", dram="1GiB", max_block="16MiB",
                 cache_remote=False, hop_timeout="2s") as pool:
        pool.wait_members(3, timeout=30)
        rows = []
        for size, count in ((4 << 20, 32), (256 << 10, 256)):
            local, remote = bench_get(pool, size, count, args.rounds)
            rows.append((f"GET {size >> 10} KiB cross-node vs local", f"{remote / 1e9:.2f} GB/s",
                         f"{local / 1e9:.2f} GB/s", f"{remote / local:.2f}x", ">= 0.5x"))
        p50, p99, ping = bench_locate(pool, args.locate_samples)
        rows.append(("LOCATE 64 keys p50 (p99) vs PING", f"{p50 * 1e3:.3f} ms ({p99 * 1e3:.3f})",
                     f"{ping * 1e3:.3f} ms", f"{p50 / ping:.2f}x", "p50 <= 0.2 ms"))
        det = bench_detect(pool, args.detect_trials)
        rows.append(("failure detection, kill -9 (lease_ttl 3 s)", f"{statistics.median(det):.2f} s "
                     f"(max {max(det):.2f})", "10-12 s Mooncake", f"{statistics.median(det) / 11:.2f}x",
                     "<= 3 s"))
    widths = [max(len(r[i]) for r in rows + [("figure", "measured", "baseline", "ratio", "target")])
              for i in range(5)]
    for r in [("figure", "measured", "baseline", "ratio", "target")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
