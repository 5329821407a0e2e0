"""The pool's figures, each with its baseline measured in the same run (issue 14).

    .venv/bin/python bench/cluster.py [--rounds 8] [--first-samples 200] [--detect-trials 3]

Starts a real etcd and three real quillcached nodes on loopback (cache_remote = false, so
every cross-node GET crosses; ``[store] prefault = true``, so that a block stored in a
fresh arena does not pay the first touch of its pages, which a node that has run for a
while never pays either), then measures:

* cross-node GET (client -> B, B fetches from A) against local GET (client -> A) of the
  same blocks, 4 MiB and 256 KiB, one client; batches of 8 GETs alternate between the two
  and the ratio is the median of adjacent pairs (machine noise falls on both); target >= 0.5x;
* the same for GET_MANY of 16 blocks of 256 KiB (how an engine reads a prefix): one
  batched FETCH per holder against one local GET_MANY (no target);
* the two-hop floor: the same sizes through raw Python sockets, client -> forwarder ->
  server against client -> server (store-and-forward, no protocol, no CRC, no store): the
  most a cross-node GET through a second process could reach on this machine;
* the first cross-node GET of a block (LOCATE at its home, then FETCH) against a repeated
  one (the holder remembered: FETCH only), 256 KiB, p50;
* a located GET through B's Unix socket of a block held on A (LOCATE, FETCH, stored in B's
  arena) against the same located GET repeated (B's own copy now), 256 KiB, p50;
* LOCATE of a batch of 64 keys at their home (the request a missing node sends), p50
  and p99, against a PING round trip on the same kind of connection; target p50 <= 0.2 ms;
* failure detection: kill -9 of a node until the others' views drop it, with the
  default lease_ttl (3 s), against a node frozen by SIGSTOP (its sockets stay open, so only
  its lease's expiry removes it: what a lease alone detects); target <= 3 s (Mooncake's
  stale window: 10-12 s).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quillcache import Client
from quillcache.protocol import cluster as wire
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.model import KvBlockKey, encode_key
from quillcache.protocol.opcodes import Opcode
from tests._support.cluster import Pool, cluster_view, member, unix_addr
from tests._support.etcd import EtcdServer
from bench._rawsock import REQUEST, accept, listen, raw_server, recv_exact
from bench._serve import scratch


def key(i: int, tag: str) -> KvBlockKey:
    return KvBlockKey("bench", "tok", None, "t0", f"{tag}-p{i // 16}", f"{tag}-b{i}")


BATCH = 8                   # GETs timed together before switching between local and remote


def batch_seconds(client: Client, keys, size: int, check: bytes) -> float:
    t0 = time.perf_counter()
    for k in keys:
        data = client.get(k)
        if len(data) != size or data[:len(check)] != check:
            raise SystemExit("wrong bytes")
    return time.perf_counter() - t0


def interleaved(one, other, batches, rounds: int, first_round: int = 0) -> tuple[float, float, float]:
    """Time ``one(batch)`` and ``other(batch)`` alternately (the order flips every round; a
    caller running one round at a time passes its round number as ``first_round``, so that
    the order flips between its calls too); returns (median seconds of one batch, of the
    other, median of the adjacent ratios one/other: the throughput of ``other`` relative to
    ``one``)."""
    t_one, t_other, ratios = [], [], []
    for r in range(first_round, first_round + rounds):
        for batch in batches:
            if r % 2:
                b = other(batch)
                a = one(batch)
            else:
                a = one(batch)
                b = other(batch)
            t_one.append(a)
            t_other.append(b)
            ratios.append(a / b)
    return statistics.median(t_one), statistics.median(t_other), statistics.median(ratios)


def bench_get(pool: Pool, size: int, count: int, rounds: int) -> tuple[float, float, float]:
    """(local bytes/s, cross-node bytes/s, cross-node/local) for GETs of ``size``."""
    tag = f"g{size}"
    payload = os.urandom(size)
    keys = [key(i, tag) for i in range(count)]
    with Client(pool["a"].addr, timeout=30) as a:
        for k in keys:
            a.put(k, payload)
    time.sleep(0.2)                          # the records reach their homes
    batches = [keys[i:i + BATCH] for i in range(0, count, BATCH)]
    with Client(pool["a"].addr, timeout=30) as a, Client(pool["b"].addr, timeout=30) as b:
        batch_seconds(a, keys, size, payload[:64])       # warm: connections, page cache, holders
        batch_seconds(b, keys, size, payload[:64])
        local, remote, ratio = interleaved(lambda ks: batch_seconds(a, ks, size, payload[:64]),
                                           lambda ks: batch_seconds(b, ks, size, payload[:64]),
                                           batches, rounds)
    return BATCH * size / local, BATCH * size / remote, ratio


def bench_get_many(pool: Pool, size: int, batch: int, rounds: int) -> tuple[float, float, float]:
    """(local bytes/s, cross-node bytes/s, cross-node/local) for GET_MANY of ``batch`` blocks."""
    payload = os.urandom(size)
    keys = [key(i, f"many{size}") for i in range(batch * 8)]
    with Client(pool["a"].addr, timeout=30) as a:
        a.put_many([(k, payload) for k in keys])
    time.sleep(0.2)                          # the records reach their homes
    batches = [keys[i:i + batch] for i in range(0, len(keys), batch)]

    def timed(c: Client, ks) -> float:
        t0 = time.perf_counter()
        got = c.get_many(ks)
        dt = time.perf_counter() - t0
        if any(g is None or len(g) != size or g[:64] != payload[:64] for g in got):
            raise SystemExit("wrong bytes or a miss")
        return dt

    with Client(pool["a"].addr, timeout=30) as a, Client(pool["b"].addr, timeout=30) as b:
        timed(a, keys[:batch])
        timed(b, keys[:batch])
        local, remote, ratio = interleaved(lambda ks: timed(a, ks), lambda ks: timed(b, ks), batches, rounds)
    return batch * size / local, batch * size / remote, ratio


def bench_first_get(pool: Pool, size: int, count: int) -> tuple[float, float]:
    """p50 seconds of a block's first cross-node GET (LOCATE + FETCH) and of a repeated one."""
    payload = os.urandom(size)
    first, again = [], []
    keys = [key(r, f"first{size}") for r in range(count)]
    with Client(pool["a"].addr, timeout=30) as a:
        for k in keys:
            a.put(k, payload)
    time.sleep(0.2)                          # the records reach their homes
    with Client(pool["b"].addr, timeout=30) as b:
        for k in keys:
            t0 = time.perf_counter()
            if b.get(k) != payload:
                raise SystemExit("wrong bytes")
            t1 = time.perf_counter()
            b.get(k)
            first.append(t1 - t0)
            again.append(time.perf_counter() - t1)
    return statistics.median(first), statistics.median(again)


def bench_located(pool: Pool, size: int, count: int) -> tuple[float, float]:
    """p50 seconds of a located GET on B of a block held on A (fetched into B's arena) and of
    the same located GET repeated (B's copy)."""
    payload = os.urandom(size)
    keys = [key(r, f"located{size}") for r in range(count)]
    with Client(pool["a"].addr, timeout=30) as a:
        for k in keys:
            a.put(k, payload)
    time.sleep(0.2)                          # the records reach their homes
    first, again = [], []
    with Client(unix_addr(pool["b"]), timeout=30) as b:
        if not b.shm:
            raise SystemExit(f"B's arena was not mapped: {b.shm_refused}")
        for k in keys:
            for out in (first, again):
                t0 = time.perf_counter()
                with b.get_many_located([k]) as views:
                    if views[0] is None or views[0][:64] != payload[:64]:
                        raise SystemExit("wrong bytes or a miss")
                out.append(time.perf_counter() - t0)
    return statistics.median(first), statistics.median(again)


# ---------------------------------------------------------------- the two-hop floor (raw sockets)

def _raw_forwarder(ls: socket.socket, upstream: int, size: int) -> None:
    """Store-and-forward: read a request, ask the server, receive all, then send all."""
    up = socket.create_connection(("127.0.0.1", upstream))
    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(size))
    req = memoryview(bytearray(len(REQUEST)))
    c = accept(ls)
    try:
        while True:
            recv_exact(c, req)
            up.sendall(req)
            recv_exact(up, buf)
            c.sendall(buf)
    except (EOFError, OSError):
        pass                                # the bench closed its connection


def bench_floor(size: int, batches: int, rounds: int) -> tuple[float, float, float]:
    """(direct bytes/s, forwarded bytes/s, forwarded/direct) with raw sockets."""
    ctx = multiprocessing.get_context("fork")
    ls_server, ls_fwd = listen(), listen()
    procs = [ctx.Process(target=raw_server, args=(ls_server, size), daemon=True),
             ctx.Process(target=_raw_forwarder, args=(ls_fwd, ls_server.getsockname()[1], size), daemon=True)]
    for p in procs:
        p.start()
    try:
        direct = socket.create_connection(ls_server.getsockname())
        fwd = socket.create_connection(ls_fwd.getsockname())
        buf = memoryview(bytearray(size))

        def timed(s: socket.socket) -> float:
            t0 = time.perf_counter()
            for _ in range(BATCH):
                s.sendall(REQUEST)
                recv_exact(s, buf)
            return time.perf_counter() - t0

        for s in (direct, fwd):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            timed(s)
        d, f, ratio = interleaved(lambda _: timed(direct), lambda _: timed(fwd), range(batches), rounds)
        direct.close()
        fwd.close()
        return BATCH * size / d, BATCH * size / f, ratio
    finally:
        for p in procs:
            p.kill()
            p.join()
        ls_server.close()
        ls_fwd.close()


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
    lat, ping = [], []
    with member(pool["a"].addr, "bench", peer_id="node-a") as peer:
        body = wire.encode_locate([encode_key(k) for k in keys], peer.limits)
        found = wire.decode_locate_reply(peer.call(Opcode.LOCATE, body).header, peer.limits)
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


def bench_detect(pool: Pool, trials: int, sig: int = signal.SIGKILL) -> list[float]:
    """Seconds from ``sig`` to a node until B's view no longer has it up, per trial.

    SIGKILL closes the node's sockets (its peers' sentinels see EOF, probe its port and revoke
    its lease); SIGSTOP freezes it with its sockets open, so only its lease's TTL removes it:
    the detection a lease alone gives, the baseline of the kill -9 row.  A stopped node is
    killed once it is gone from the view."""
    out = []
    for t in range(trials):
        name = f"x{t}" if sig == signal.SIGKILL else f"s{t}"
        victim = pool.add(name)
        pool.wait_members(4, timeout=30)
        victim.send(sig)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            ids = {m["node_id"] for m in cluster_view(pool["b"].addr)["members"] if m["state"] == "up"}
            if f"node-{name}" not in ids:
                break
            time.sleep(0.01)
        out.append(time.monotonic() - t0)
        if sig != signal.SIGKILL:
            victim.send(signal.SIGKILL)
        victim.wait(5)
        pool.wait_members(3, timeout=30)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--first-samples", type=int, default=200)
    ap.add_argument("--locate-samples", type=int, default=3000)
    ap.add_argument("--detect-trials", type=int, default=3)
    args = ap.parse_args(argv)
    with scratch("qc-bench-cluster-", "bench/cluster.py") as tmp, EtcdServer(tmp / "etcd") as etcd, \
            Pool(tmp, etcd.endpoint, 3, lease_ttl="3s", dram="1GiB", max_block="16MiB",
                 cache_remote=False, hop_timeout="2s", sections={"store": "prefault = true"}) as pool:
        pool.wait_members(3, timeout=30)
        rows = []
        for size, count in ((4 << 20, 32), (256 << 10, 256)):
            local, remote, ratio = bench_get(pool, size, count, args.rounds)
            rows.append((f"GET {size >> 10} KiB cross-node vs local", f"{remote / 1e9:.2f} GB/s",
                         f"{local / 1e9:.2f} GB/s", f"{ratio:.2f}x", ">= 0.5x"))
        local, remote, ratio = bench_get_many(pool, 256 << 10, 16, args.rounds)
        rows.append(("GET_MANY 16 x 256 KiB cross-node vs local", f"{remote / 1e9:.2f} GB/s",
                     f"{local / 1e9:.2f} GB/s", f"{ratio:.2f}x", "-"))
        for size, count in ((4 << 20, 32), (256 << 10, 256)):
            direct, fwd, ratio = bench_floor(size, count // BATCH, args.rounds)
            rows.append((f"two-hop floor {size >> 10} KiB (raw sockets)", f"{fwd / 1e9:.2f} GB/s",
                         f"{direct / 1e9:.2f} GB/s", f"{ratio:.2f}x", "(ceiling of the row)"))
        first, again = bench_first_get(pool, 256 << 10, args.first_samples)
        rows.append(("first cross-node GET 256 KiB vs repeated, p50", f"{first * 1e3:.3f} ms",
                     f"{again * 1e3:.3f} ms", f"{first / again:.2f}x", "-"))
        first, again = bench_located(pool, 256 << 10, args.first_samples)
        rows.append(("located GET 256 KiB from A via B vs B's copy, p50", f"{first * 1e3:.3f} ms",
                     f"{again * 1e3:.3f} ms", f"{first / again:.2f}x", "-"))
        p50, p99, ping = bench_locate(pool, args.locate_samples)
        rows.append(("LOCATE 64 keys p50 (p99) vs PING", f"{p50 * 1e3:.3f} ms ({p99 * 1e3:.3f})",
                     f"{ping * 1e3:.3f} ms", f"{p50 / ping:.2f}x", "p50 <= 0.2 ms"))
        det = bench_detect(pool, args.detect_trials)
        ttl_only = bench_detect(pool, args.detect_trials, signal.SIGSTOP)
        rows.append(("failure detection, kill -9 vs stopped (lease_ttl 3 s)", f"{statistics.median(det):.2f} s "
                     f"(max {max(det):.2f})", f"{statistics.median(ttl_only):.2f} s (max {max(ttl_only):.2f})",
                     f"{statistics.median(det) / statistics.median(ttl_only):.2f}x", "<= 3 s"))
    widths = [max(len(r[i]) for r in rows + [("figure", "measured", "baseline", "ratio", "target")])
              for i in range(5)]
    for r in [("figure", "measured", "baseline", "ratio", "target")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
