"""What the TCP congestion control costs a request/reply on loopback: a raw socket that answers
an 8-byte request with a reply of SIZE bytes, its sending end on the system's congestion
control (``net.ipv4.tcp_congestion_control``) and on ``reno``, taking turns.  No QuillCache code
on the path: this is the kernel's part of ``[node] loopback_congestion`` (docs/protocol.md,
"Same-host TCP").

    python bench/loopback_congestion.py [--sizes 256K,4M,16M] [--rounds 5] [--seconds 0.5]

The replying process and the client are pinned to one CPU each (as bench/vs_peers.py pins
its servers and clients); each reply comes from one preallocated buffer (``sendall``) and
lands in another (``recv_into`` with MSG_WAITALL).  A connection is made per round and per
congestion control, so neither inherits the other's state.  MB/s here is MiB/s: best round,
with the median reply time over all rounds.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

from quillcache.net import LOOPBACK_CONGESTION, set_congestion

MiB = 1 << 20
NAME_BYTES = 16                 # the congestion control's name, NUL-padded (TCP_CA_NAME_MAX)
REQUEST = struct.Struct("<Q")   # the reply's size


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(t[:-1]) * units[t[-1]] if t[-1] in units else int(t)


def system_congestion() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


def serve(listener: socket.socket, max_size: int, cpu) -> None:
    """The replying process: per connection, set the named congestion control, then answer
    each request with that many bytes until the client closes."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    payload = memoryview(bytearray(os.urandom(1024)) * (max_size // 1024 + 1))[:max_size]
    head = bytearray(NAME_BYTES)
    req = bytearray(REQUEST.size)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not _recv_exact(conn, memoryview(head)):
                continue
            name = bytes(head).rstrip(b"\0").decode()
            ok = set_congestion(conn, name) if name else True
            conn.sendall(b"\1" if ok else b"\0")
            while _recv_exact(conn, memoryview(req)):
                (n,) = REQUEST.unpack(req)
                conn.sendall(payload[:n])


def one_round(port: int, name: str, size: int, seconds: float) -> tuple[float, list[float]]:
    """A fresh connection whose replying end runs ``name`` ("" = the system's): (MiB/s, reply
    times in s) over ``seconds`` of back-to-back requests."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(name.encode().ljust(NAME_BYTES, b"\0"))
        ack = bytearray(1)
        if not _recv_exact(s, memoryview(ack)) or ack[0] != 1:
            raise SystemExit(f"the kernel refuses congestion control {name!r} "
                             "(net.ipv4.tcp_allowed_congestion_control)")
        buf = memoryview(bytearray(size))
        req = REQUEST.pack(size)
        times = []
        for _ in range(3):                  # untimed: the connection's first replies
            s.sendall(req)
            _recv_exact(s, buf)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            s.sendall(req)
            if not _recv_exact(s, buf):
                raise SystemExit("the replying process closed the connection")
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
    sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or max(sizes) > 1 << 30 or args.rounds < 1 or not args.seconds > 0:
        ap.error("sizes of 1 B to 1 GiB, --rounds >= 1, --seconds > 0")
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:                            # the replying process
        try:
            serve(listener, max(sizes), server_cpu)
        finally:
            os._exit(0)
    listener.close()
    system = system_congestion()
    try:
        if client_cpu is not None:
            os.sched_setaffinity(0, {client_cpu})
        print(f"system congestion control: {system}; compared: {args.congestion}; "
              f"replying process on CPU {server_cpu}, client on CPU {client_cpu}; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        print()
        print(f"| reply | {system} MB/s | {args.congestion} MB/s | {args.congestion} / {system} "
              f"| p50 ms {system} | p50 ms {args.congestion} |")
        print("|---:|---:|---:|---:|---:|---:|")
        for size in sizes:
            best = {"": 0.0, args.congestion: 0.0}
            times: dict[str, list[float]] = {"": [], args.congestion: []}
            for _ in range(args.rounds):
                for name in ("", args.congestion):      # taking turns, round by round
                    mbs, t = one_round(port, name, size, args.seconds)
                    best[name] = max(best[name], mbs)
                    times[name] += t
            label = f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"
            p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {label} | {best['']:,.0f} | {best[args.congestion]:,.0f} | "
                  f"{best[args.congestion] / best[''] if best[''] else 0:.2f}x | {p50['']:.3f} | "
                  f"{p50[args.congestion]:.3f} |", flush=True)
        print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
