"""What the TCP congestion control costs a request/reply on loopback: a raw socket that answers
an 8-byte request with a reply of SIZE bytes, its sending end on the system's congestion
control (``net.ipv4.tcp_congestion_control``) and on ``reno``, taking turns.  No QuillCache code
on the path: this is the kernel's part of ``[node] loopback_congestion`` (docs/protocol.md,
"Same-host TCP").

    python bench/loopback_congestion.py [--sizes 256K,4M,16M] [--rounds 5] [--seconds 0.5]

The replying processes (bench/_rawsock.py's ``raw_server``, one per congestion control) and the
client are pinned to one CPU each (as bench/vs_peers.py pins its servers and clients); each
reply comes from one buffer and lands in another.  A connection is made per round, so neither
congestion control's connection inherits the other's state.  MB/s here is MiB/s: best round,
with the median reply time over all rounds.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))        # vs_peers, as a script or imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench._rawsock
from bench._rawsock import REQUEST, listen, raw_server, recv_exact
from quillcache.net import LOOPBACK_CONGESTION, set_congestion, system_congestion
from vs_peers import parse_sizes, size_label

MiB = 1 << 20


def refused(name: str) -> bool:
    """Whether the kernel refuses ``name`` on a connected TCP socket of this user."""
    ls = listen()
    try:
        with socket.create_connection(ls.getsockname()) as c:
            s, _ = ls.accept()
            with s:
                return not set_congestion(c, name)
    finally:
        ls.close()


def one_round(address, size: int, seconds: float) -> tuple[float, list[float]]:
    """A fresh connection to ``address``: (MiB/s, reply times in s) over ``seconds`` of
    back-to-back requests."""
    with socket.create_connection(address, timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(size))
        times = []
        for _ in range(3):                  # untimed: the connection's first replies
            s.sendall(REQUEST)
            recv_exact(s, buf)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            s.sendall(REQUEST)
            recv_exact(s, buf)
            times.append(time.perf_counter() - t0)
    return size * len(times) / MiB / sum(times), times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256K,4M,16M", help="reply sizes (K = KiB, M = MiB)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per congestion control and size")
    ap.add_argument("--seconds", type=float, default=0.5, help="timed requests per round, in seconds")
    ap.add_argument("--congestion", default=LOOPBACK_CONGESTION,
                    help="the one compared with the system's (default: %(default)s)")
    args = ap.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    if not sizes or min(sizes) < 1 or max(sizes) > 1 << 30 or args.rounds < 1 or not args.seconds > 0:
        ap.error("sizes of 1 B to 1 GiB, --rounds >= 1, --seconds > 0")
    if refused(args.congestion):
        ap.error(f"the kernel refuses congestion control {args.congestion!r} "
                 "(net.ipv4.tcp_allowed_congestion_control)")
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    system = system_congestion() or "unknown"
    print(f"system congestion control: {system}; compared: {args.congestion}; "
          f"replying processes on CPU {server_cpu}, client on CPU {client_cpu}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print()
    print(f"| reply | {system} MB/s | {args.congestion} MB/s | {args.congestion} / {system} "
          f"| p50 ms {system} | p50 ms {args.congestion} |")
    print("|---:|---:|---:|---:|---:|---:|")
    ctx = multiprocessing.get_context("fork")
    mine = os.sched_getaffinity(0)
    for size in sizes:
        names = ("", args.congestion)
        listeners = {name: listen() for name in names}
        if server_cpu is not None:
            os.sched_setaffinity(0, {server_cpu})       # the servers inherit it at the fork
        procs = [ctx.Process(target=raw_server, args=(listeners[name], size, name), daemon=True) for name in names]
        for p in procs:
            p.start()
        os.sched_setaffinity(0, {client_cpu} if client_cpu is not None else mine)
        try:
            best = dict.fromkeys(names, 0.0)
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:                      # taking turns, round by round
                    mbs, t = one_round(listeners[name].getsockname(), size, args.seconds)
                    best[name] = max(best[name], mbs)
                    times[name] += t
        finally:
            for p in procs:
                p.kill()
                p.join()
            for ls in listeners.values():
                ls.close()
        p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        sys_mbs, cc_mbs = best[""], best[args.congestion]
        print(f"| {size_label(size)} | {sys_mbs:,.0f} | {cc_mbs:,.0f} | {cc_mbs / sys_mbs if sys_mbs else 0:.2f}x | "
              f"{p50['']:.3f} | {p50[args.congestion]:.3f} |", flush=True)
    os.sched_setaffinity(0, mine)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
