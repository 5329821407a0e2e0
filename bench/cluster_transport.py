"""Cross-node reads on each transport, in one run (issue 25).

    .venv/bin/python bench/cluster_transport.py [--transport tcp,nixl,nixl-ucx-tcp] [--rounds 6]

One real etcd and, per transport, a pool of two real quillcached nodes (A holds, B reads;
``cache_remote = false``, so every GET at B crosses; ``[store] prefault = true``):

* ``tcp``: ``[cluster] transport = "tcp"`` (FETCH: the holder's Python sends the bytes);
* ``nixl``: ``transport = "nixl"`` under UCX's default transports (shared memory / CMA on one
  host, standing in for an RDMA fabric);
* ``nixl-ucx-tcp``: ``transport = "nixl"`` with ``UCX_TLS=tcp`` (as between hosts without RDMA);
* ``nixl-no-reuse``, ``nixl-ucx-tcp-no-reuse``: the same with ``grant_reuse = "0s"``: one GRANT
  per read, as for a block read once (the others read each block again within its grant's reuse
  window: every round reads the same keys).

Every pool is up at once and the measurements alternate between them, round by round, so machine
noise falls on all.  Figures, per transport: MB/s of GET 256 KiB, GET 4 MiB and GET_MANY 64 x
256 KiB through B (cross-node) and through A (local), and their ratio (bench/cluster.py's
``interleaved``: the median of adjacent pairs); then the holder's CPU per cross-node 256 KiB GET:
the CPU time of every thread of A's process (``/proc/<pid>/task/*/schedstat``) over N GETs at B,
divided by N, with the same N GETs at the reader B for reference.

The client (this process) keeps the memory it frees (glibc ``mallopt``: no trim, no mmap per
block; ``--client-heap default`` leaves glibc's defaults): otherwise a GET_MANY reply of 16 MiB
can land in 4,096 freshly faulted pages, about 10 ms of the client's CPU on this VM, and whether
it does depends on glibc's dynamic mmap threshold, not on the node (measured: the same local
GET_MANY 6 or 13 ms, a cross-node one 10 or 18 ms, by the order of the requests alone).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster import BATCH, batch_seconds, interleaved, key  # noqa: E402  (bench/cluster.py)

from quillcache import Client  # noqa: E402
from tests._support.cluster import Pool  # noqa: E402
from tests._support.etcd import EtcdServer  # noqa: E402
from bench._serve import scratch  # noqa: E402

KINDS = {"tcp": ("tcp", None, {}), "nixl": ("nixl", None, {}), "nixl-ucx-tcp": ("nixl", "tcp", {}),
         "nixl-no-reuse": ("nixl", None, {"grant_reuse": "0s"}),
         "nixl-ucx-tcp-no-reuse": ("nixl", "tcp", {"grant_reuse": "0s"}),
         "auto-ucx-tcp": ("auto", "tcp", {})}


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc mallopt parameters


def keep_client_heap() -> bool:
    """Make this process's malloc keep freed memory for reuse (no trim of the heap top, no mmap
    per large block), so replies land in pages already mapped; False where it is not glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) and libc.mallopt(M_MMAP_THRESHOLD, 64 << 20))
    except (OSError, AttributeError):
        return False


def cpu_by_thread(pid: int) -> dict[str, int]:
    """CPU time (ns) of each thread of ``pid`` so far, by thread (name/tid)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = f"{(task / 'comm').read_text().strip()}/{task.name}"
            out[name] = out.get(name, 0) + int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass                        # a thread that just ended
    return out


def cpu_ns(pid: int) -> int:
    """CPU time (ns) of every thread of ``pid`` so far."""
    return sum(cpu_by_thread(pid).values())


def wait_nixl(pool: Pool, reader: str, timeout: float = 20.0) -> None:
    """After the first read from a holder (over FETCH), wait until B knows its NIXL agent."""
    deadline = time.monotonic() + timeout
    while True:
        with Client(pool[reader].addr) as c:
            info = c.info("cluster")["Cluster"]
        if info.get("transport_nixl_peers", 0) >= 1:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{reader} never learnt its holder's NIXL agent: {info}")
        time.sleep(0.05)


class Side:
    """One pool's keys of one size, put at A; ``local``/``remote`` time a batch at A / at B."""

    def __init__(self, name: str, pool: Pool, size: int, count: int, many: int = 0) -> None:
        self.name, self.pool, self.size = name, pool, size
        self.payload = os.urandom(size)
        self.keys = [key(i, f"{name}-{size}-{many}") for i in range(count)]
        with Client(pool["a"].addr, timeout=30) as a:
            for i in range(0, count, 64):
                a.put_many([(k, self.payload) for k in self.keys[i:i + 64]])
        time.sleep(0.2)                 # the records reach their homes
        self.a = Client(pool["a"].addr, timeout=30)
        self.b = Client(pool["b"].addr, timeout=30)
        self.many = many

    def timed(self, c: Client, ks) -> float:
        if not self.many:
            return batch_seconds(c, ks, self.size, self.payload[:64])
        t0 = time.perf_counter()
        got = c.get_many(ks)
        dt = time.perf_counter() - t0
        if any(g is None or len(g) != self.size or g[:64] != self.payload[:64] for g in got):
            raise SystemExit(f"{self.name}: wrong bytes or a miss")
        return dt

    def batches(self):
        n = self.many or BATCH
        return [self.keys[i:i + n] for i in range(0, len(self.keys), n)]

    def close(self) -> None:
        self.a.close()
        self.b.close()


def measure(sides: dict[str, Side], rounds: int) -> dict[str, tuple[float, float, float]]:
    """Alternate between the transports, one round each at a time; per transport (local B/s,
    cross-node B/s, median ratio)."""
    per: dict[str, list] = {n: [[], [], []] for n in sides}
    names = list(sides)
    for r in range(rounds):
        # each round starts at the next transport: whatever the position in a round costs (the
        # last one measured ran slow locally in every run) falls on each in turn
        for name in names[r % len(names):] + names[:r % len(names)]:
            s = sides[name]
            # one round at a time: its number flips which read goes first (the second finds the
            # batch's pages warm from the first)
            lo, re, ratio = interleaved(lambda ks, s=s: s.timed(s.a, ks), lambda ks, s=s: s.timed(s.b, ks),
                                        s.batches(), 1, first_round=r)
            n = len(s.batches()[0])
            per[name][0].append(n * s.size / lo)
            per[name][1].append(n * s.size / re)
            per[name][2].append(ratio)
    return {n: tuple(statistics.median(v) for v in vals) for n, vals in per.items()}


def holder_cpu(pool: Pool, name: str, gets: int) -> tuple[float, float]:
    """(holder's CPU µs, reader's CPU µs) per cross-node 256 KiB GET at B."""
    s = Side(f"cpu-{name}", pool, 256 << 10, 64)
    try:
        for k in s.keys:
            s.b.get(k)
        pa, pb = pool["a"].proc.pid, pool["b"].proc.pid
        a0, b0 = cpu_by_thread(pa), cpu_by_thread(pb)
        for i in range(gets):
            if len(s.b.get(s.keys[i % len(s.keys)])) != s.size:
                raise SystemExit("wrong size")
        a1, b1 = cpu_by_thread(pa), cpu_by_thread(pb)
        for side, t0, t1 in (("holder", a0, a1), ("reader", b0, b1)):
            per = {n: (t1[n] - t0.get(n, 0)) / gets / 1e3 for n in t1 if t1[n] - t0.get(n, 0) > 0}
            print(f"# {name} {side} CPU per GET by thread: "
                  + ", ".join(f"{n} {us:.1f} µs" for n, us in sorted(per.items(), key=lambda x: -x[1])))
        return (sum(a1.values()) - sum(a0.values())) / gets / 1e3, (sum(b1.values()) - sum(b0.values())) / gets / 1e3
    finally:
        s.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="tcp,nixl,nixl-ucx-tcp",
                    help="comma-separated: tcp, nixl (UCX default transports), nixl-ucx-tcp (UCX_TLS=tcp)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cpu-gets", type=int, default=2000)
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="skip bench/nixl_ceiling.py (the ceiling the bytes alone leave, printed after nixl)")
    ap.add_argument("--hugepages", action="store_true",
                    help="the nodes' arenas with [store] hugepages = true (INFO's dram_backing is printed)")
    ap.add_argument("--client-heap", choices=("kept", "default"), default="kept",
                    help="kept: the client reuses freed memory (see above); default: glibc's defaults")
    args = ap.parse_args(argv)
    store_section = "prefault = true\nhugepages = true" if args.hugepages else "prefault = true"
    if args.client_heap == "kept" and not keep_client_heap():
        print("# the client's heap could not be kept (not glibc): GET_MANY figures include its page faults")
    names = [n.strip() for n in args.transport.split(",") if n.strip()]
    for n in names:
        if n not in KINDS:
            raise SystemExit(f"--transport {n!r}: one of {', '.join(KINDS)}")
    pools: dict[str, Pool] = {}
    with scratch("qc-bench-transport-", "bench/cluster_transport.py") as tmp, EtcdServer(tmp / "etcd") as etcd:
        try:
            for n in names:
                kind, tls, more = KINDS[n]
                pool = Pool(tmp / n, etcd.endpoint, 2, lease_ttl="3s", dram="512MiB", max_block="16MiB",
                            cache_remote=False, hop_timeout="2s", sections={"store": store_section},
                            cluster_id=f"bench-{n}", transport=kind, **more)
                for d in pool.nodes.values():
                    d.env.pop("UCX_TLS", None)
                    if tls:
                        d.env["UCX_TLS"] = tls
                pools[n] = pool.start()
            for pool in pools.values():
                pool.wait_members(2, timeout=30)
            rows = []
            for label, size, count, many in (("GET 256 KiB", 256 << 10, 128, 0), ("GET 4 MiB", 4 << 20, 16, 0),
                                              ("GET_MANY 64 x 256 KiB", 256 << 10, 256, 64)):
                sides = {n: Side(n, p, size, count, many) for n, p in pools.items()}
                try:
                    for n, s in sides.items():          # warm: links, the holder's agent, page cache
                        for batch in s.batches():
                            s.timed(s.b, batch)
                        if KINDS[n][0] == "nixl":
                            wait_nixl(s.pool, "b")
                        for batch in s.batches():
                            s.timed(s.a, batch)
                            s.timed(s.b, batch)
                    got = measure(sides, args.rounds)
                finally:
                    for s in sides.values():
                        s.close()
                for n in names:
                    lo, re, ratio = got[n]
                    rows.append((label, n, lo / 1e6, re / 1e6, ratio))
            cpu = {n: holder_cpu(p, n, args.cpu_gets) for n, p in pools.items()}
            for n, p in pools.items():
                with Client(p["b"].addr) as c:
                    info = c.info("cluster")["Cluster"]
                    backing = c.info("tiers")["Tiers"]["dram_backing"]
                print(f"# {n}: arenas {backing}, B's transport {info['transport_transport']}, nixl_reads "
                      f"{info.get('transport_nixl_reads', 0)} ({info.get('transport_nixl_reads_inline', 0)} done at "
                      f"once), blocks read under a reused grant {info.get('transport_nixl_grant_reuses', 0)}, "
                      f"nixl_fallbacks {info.get('transport_nixl_fallbacks', 0)}, FETCHes {info['transport_fetches']}")
        finally:
            for p in pools.values():
                p.close()
    print("\n| read | transport | local MB/s | cross-node MB/s | cross-node / local |\n|---|---|---|---|---|")
    for label, n, lo, re, ratio in rows:
        print(f"| {label} | {n} | {lo:,.0f} | {re:,.0f} | {ratio:.2f}x |")
    print("\n| transport | holder CPU per cross-node 256 KiB GET | reader CPU per GET |\n|---|---|---|")
    for n, (ha, rb) in cpu.items():
        print(f"| {n} | {ha:.1f} µs | {rb:.1f} µs |")
    if "tcp" in cpu:
        for n, (ha, _) in cpu.items():
            if n != "tcp":
                print(f"holder CPU {n} / tcp: {ha / cpu['tcp'][0]:.2f}")
    if "nixl" in names and args.ceiling:
        print_ceiling({label: lo for label, n, lo, _, _ in rows if n == "nixl"}, args.hugepages)
    return 0


def print_ceiling(local_mbs: dict[str, float], hugepages: bool) -> None:
    """The best cross-node / local ratio a reader on this host can reach under UCX's default
    transports: a local GET's time (this run's) plus one NIXL READ of the bytes and their CRC
    (bench/nixl_ceiling.py, in a process of its own: it makes NIXL agents), done one after the other
    as a node's loop does them."""
    import json
    import subprocess
    cmd = [sys.executable, str(ROOT / "bench" / "nixl_ceiling.py"), "--json", "--reps", "100",
           "--region-mib", "64"] + (["--hugepages"] if hugepages else [])
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    got = next((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), None)
    if got is None:
        print(f"\n# no ceiling: bench/nixl_ceiling.py said {(out.stdout + out.stderr).strip()[-300:]!r}")
        return
    print(f"\nWhat the bytes alone cost a reader on this host (bench/nixl_ceiling.py: the holder's arena "
          f"{got['backing']}, 64 MiB read in turn), and the best cross-node / local they leave: "
          f"local / (local + READ + CRC)\n")
    print("| read | local µs (this run) | NIXL READ µs | CRC32C µs | ceiling |\n|---|---:|---:|---:|---:|")
    for label, mbs in local_mbs.items():
        c = got["cases"].get(label)
        if c is None or mbs <= 0:
            continue
        local_us = c["bytes"] / mbs         # MB/s = bytes per µs
        print(f"| {label} | {local_us:,.0f} | {c['read_us']:,.0f} | {c['crc_us']:,.0f} | "
              f"{local_us / (local_us + c['read_us'] + c['crc_us']):.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
