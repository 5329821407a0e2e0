"""What the client's busy-polling receive (``Client(spin_us=...)``, docs/protocol.md
"Busy-polling receives") buys a request/reply against a real node: the same GETs and PUTs
from a client that polls (``--spin-us``, default the client's own) and from one that sleeps
at once (``spin_us=0``, the baseline), taking turns pass by pass in one run.

    python bench/receive_poll.py [--sizes 1K,64K,256K,4M] [--rounds 5] [--spin-us 100] [--no-pin]

One node (``bench/_local_node.py``, DRAM only).  The node runs on the first CPU and the
client on the second (as bench/vs_peers.py places them; ``--no-pin`` leaves it to the
scheduler).  Per size, op and client: the median request time over all passes, and the CPU
per request of the client (its thread) and of the node (every thread, from
``/proc/<pid>/task/*/schedstat``), best pass.  The ratio is sleeping / polling: above 1, polling
is faster.  The polling client's ``receive_stats()`` says how often the poll caught the reply.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))        # vs_peers, _local_node
from _local_node import LocalNode
from cluster_transport import cpu_ns      # every thread's CPU ns, from schedstat
from vs_peers import parse_sizes, size_label

from quillcache.client import Client
from quillcache.client.calls import DEFAULT_SPIN_US
from quillcache.model import KvBlockKey

WORKING_SET = 64 << 20          # bytes of distinct values per size ...
MAX_KEYS = 1024                 # ... at most this many keys


def one_pass(client: Client, keys, value, op: str, pid: int):
    """(request times, client CPU s per request, node CPU s per request) of one pass."""
    lat = []
    fn = client.get if op == "get" else (lambda k: client.put(k, value))
    n0, c0 = cpu_ns(pid), time.thread_time()
    for k in keys:
        t0 = time.perf_counter()
        got = fn(k)
        lat.append(time.perf_counter() - t0)
        if op == "get" and len(got) != len(value):
            raise AssertionError(f"GET returned {len(got)} bytes, {len(value)} were put")
    n = len(keys)
    return lat, (time.thread_time() - c0) / n, (cpu_ns(pid) - n0) / 1e9 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1K,64K,256K,4M"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_US)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    with LocalNode(dram="2GiB") as node:
        pid = node.proc.pid
        if len(cpus) >= 2 and not args.no_pin:
            for task in glob.glob(f"/proc/{pid}/task/*"):
                os.sched_setaffinity(int(Path(task).name), {cpus[0]})
            os.sched_setaffinity(0, {cpus[1]})
            print(f"placement: node on CPU {cpus[0]}, client on CPU {cpus[1]}")
        clients = {"poll": Client(node.tcp, spin_us=args.spin_us), "sleep": Client(node.tcp, spin_us=0)}
        print(f"spin_us: poll {clients['poll'].spin_us:g}, sleep 0; load average {os.getloadavg()[0]:.2f}")
        print(f"{'size':>6s} {'op':3s} {'p50 poll':>9s} {'p50 sleep':>10s} {'ratio':>6s}  "
              f"{'client CPU poll/sleep':>22s}  {'node CPU poll/sleep':>20s}  (us per request)")
        rows = []
        for size in args.sizes:
            count = max(2, min(MAX_KEYS, WORKING_SET // size))
            keys = [KvBlockKey("bench-model", "bench-tok", None, "default", "root", f"poll:{size}:{i}", 0, 64)
                    for i in range(count)]
            value = os.urandom(size)
            for k in keys:
                clients["sleep"].put(k, value)
            for op in ("put", "get"):
                for c in clients.values():                  # one untimed pass each
                    one_pass(c, keys, value, op, pid)
                got = {name: ([], [], []) for name in clients}
                for _ in range(args.rounds):
                    for name, c in clients.items():
                        lat, ccpu, ncpu = one_pass(c, keys, value, op, pid)
                        got[name][0].extend(lat)
                        got[name][1].append(ccpu)
                        got[name][2].append(ncpu)
                p50 = {name: statistics.median(v[0]) * 1e6 for name, v in got.items()}
                cc = {name: min(v[1]) * 1e6 for name, v in got.items()}
                nc = {name: min(v[2]) * 1e6 for name, v in got.items()}
                ratio = p50["sleep"] / p50["poll"]
                rows.append(ratio)
                print(f"{size_label(size):>6s} {op.upper():3s} {p50['poll']:9.1f} {p50['sleep']:10.1f} {ratio:5.2f}x  "
                      f"{cc['poll']:10.1f} / {cc['sleep']:9.1f}  {nc['poll']:9.1f} / {nc['sleep']:8.1f}")
        print(f"polling client: {clients['poll'].receive_stats()}")
        print(f"ratio (p50 sleeping / polling): {min(rows):.2f}x to {max(rows):.2f}x; load average "
              f"{os.getloadavg()[0]:.2f}")
        for c in clients.values():
            c.close()


if __name__ == "__main__":
    main()
