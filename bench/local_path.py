"""The same-host data path: TCP against the Unix socket with the mapped arena (docs/shm.md).

One DRAM-only quillcached (started here, stopped at the end); batches of 256 blocks of
256 KiB and of 4 MiB; every side touches every byte:

  GET  tcp          Client(tcp).get_many_into(keys, buffers)            (the baseline; 4 MiB blocks
                    in requests of 128 MiB: the client refuses GET_MANY replies over 256 MiB)
       unix memcpy  Client(unix).get_many_into(keys, buffers)           (located GET + one memcpy per block)
       located copy get_many_located(keys), each view copied into its buffer
       located read get_many_located(keys), each view summed in place (no copy: reads every byte)
  PUT  tcp          Client(tcp).put_many(items)                         (the baseline)
       unix memcpy  Client(unix).put_many(items)                        (reserve + memcpy + commit)
       reserved     put_many_reserved(...), the producer writes each slot (np.copyto)

plus the control cost per block: GET_LOCATED + RELEASE, and RESERVE + COMMIT, of 256 keys
without touching the bytes, divided by 256 (RESERVE + COMMIT of the same keys each round, a
rewrite, which is what the target is set on; and of 256 keys never put before, as an engine's
save of a new prefix is: each then also makes the block's entry and its residency record): the best of the rounds (the cost; the median on
a shared machine is mostly other processes), the median, and the CPU seconds the client and
the node spent per block (``time.process_time`` and /proc/<pid>/stat).  Every GET result is checked against what was
put, outside the timed calls.  The sides of a direction run interleaved, after one untimed
call each: each round calls every side once, in an order rotated each round, so none is timed
on arena pages or socket buffers that another side warmed for it.  MB/s = MiB moved / seconds
inside the calls (median of the rounds); ratios are against TCP in the same run.

    python bench/local_path.py [--rounds N] [--no-pin]

Targets (issue 26, on the 2-core dev machine): GET and PUT through the mapping >= 3x TCP;
control cost <= 1.0 us per block for GET_LOCATED + RELEASE, <= 1.5 us for RESERVE + COMMIT.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _local_node import LocalNode

KiB, MiB = 1 << 10, 1 << 20
BATCH = 256                          # blocks per request
SIZES = (256 * KiB, 4 * MiB)
ROUNDS = {256 * KiB: 9, 4 * MiB: 3}  # timed rounds per side (median reported)
CONTROL_ROUNDS = 200                 # located GET + RELEASE (and RESERVE + COMMIT) rounds
TCP_REPLY_BYTES = 128 * MiB           # bytes per GET_MANY on TCP (the client refuses replies over 256 MiB)
TARGET_GET_RATIO = 3.0               # unix GET of 256 x 256 KiB against TCP
TARGET_GET_CONTROL_US = 1.0          # microseconds per block: GET_LOCATED + RELEASE
TARGET_PUT_CONTROL_US = 1.5          # microseconds per block: RESERVE + COMMIT


def _keys(size: int):
    from quillcache import KvBlockKey
    return [KvBlockKey("bench-model", "tok", None, "", "local-path", f"{size}-{i}", 0, 16) for i in range(BATCH)]


def _interleaved(sides: dict, rounds: int, after=None) -> dict:
    """Median seconds per call of each side in ``sides`` ({name: fn}).

    Every side is called once untimed first (its first call touches arena pages and socket
    buffers no other side has), then ``rounds`` rounds call every side once each, the order
    rotated by one each round: no side always runs first, on pages its predecessor left cold
    or warm, and a change in the machine's load falls on every side alike. ``after(name)``
    runs outside the timing after each call (the byte checks).
    """
    names = list(sides)
    times: dict = {n: [] for n in names}
    for n in names:
        sides[n]()
        if after:
            after(n)
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            sides[n]()
            times[n].append(time.perf_counter() - t0)
            if after:
                after(n)
    return {n: statistics.median(t) for n, t in times.items()}


def _pin(node_pid: int, enabled: bool) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if not enabled or len(cpus) < 2:
        return "not pinned"
    half = len(cpus) // 2
    server, client = cpus[:half], cpus[half:]
    for tid in os.listdir(f"/proc/{node_pid}/task"):
        try:
            os.sched_setaffinity(int(tid), server)
        except OSError:
            pass
    os.sched_setaffinity(0, client)
    return f"server on CPUs {server}, client on {client}"


def run_size(tcp, uni, size: int, rounds: int) -> dict:
    keys = _keys(size)
    src = np.random.default_rng(size).integers(0, 256, size * BATCH, dtype=np.uint8)
    blocks = [src[i * size:(i + 1) * size] for i in range(BATCH)]
    items = list(zip(keys, blocks))
    dst = np.empty_like(src)
    bufs = [dst[i * size:(i + 1) * size] for i in range(BATCH)]
    sums = src.view(np.uint64).reshape(BATCH, -1).sum(axis=1, dtype=np.uint64)
    total = size * BATCH

    def check(what: str) -> None:
        if not np.array_equal(dst, src):
            raise SystemExit(f"{what}: wrong bytes")
        dst[:] = 0

    def located_copy():
        with uni.get_many_located(keys) as views:
            for v, b in zip(views, bufs):
                b[:] = v

    got_sums: list = []

    def located_read():
        got_sums.clear()
        with uni.get_many_located(keys) as views:
            for v in views:
                got_sums.append(np.frombuffer(v, np.uint64).sum(dtype=np.uint64))

    def reserved():
        with uni.put_many_reserved([(k, size) for k in keys]) as views:
            for v, b in zip(views, blocks):
                np.copyto(np.frombuffer(v, np.uint8), b)

    per = max(1, TCP_REPLY_BYTES // size)

    def tcp_get():
        for i in range(0, BATCH, per):      # the client takes GET_MANY replies up to 256 MiB
            tcp.get_many_into(keys[i:i + per], bufs[i:i + per])

    puts = _interleaved({"put tcp": lambda: tcp.put_many(items),
                         "put unix memcpy": lambda: uni.put_many(items),
                         "put reserved": reserved}, rounds)

    def checked(name: str) -> None:
        if name != "get located read":
            check(name)
        elif not np.array_equal(np.array(got_sums, dtype=np.uint64), sums):
            raise SystemExit("get located read: wrong bytes")

    gets = _interleaved({"get tcp": tcp_get,
                         "get unix memcpy": lambda: uni.get_many_into(keys, bufs),
                         "get located copy": located_copy,
                         "get located read": located_read}, rounds, after=checked)
    res = {name: total / t for name, t in (puts | gets).items()}
    return res


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def control_cost(uni, node_pid: int) -> dict:
    """Microseconds per block: GET_LOCATED + RELEASE, and RESERVE + COMMIT, of 256 keys:
    {name: (best, median, client CPU, node CPU)}."""
    keys = _keys(256 * KiB)

    def located():
        with uni.get_many_located(keys):
            pass

    def reserve_commit():
        with uni.put_many_reserved([(k, 4096) for k in keys]):
            pass

    fresh = iter([[(k, 4096) for k in _keys(f"new-{r}")] for r in range(CONTROL_ROUNDS + 1)])

    def reserve_commit_new():
        with uni.put_many_reserved(next(fresh)):
            pass

    out = {}
    for name, fn in (("GET_LOCATED+RELEASE", located), ("RESERVE+COMMIT", reserve_commit),
                     ("RESERVE+COMMIT new keys", reserve_commit_new)):
        fn()
        times = []
        c0, n0 = time.process_time(), _cpu_s(node_pid)
        for _ in range(CONTROL_ROUNDS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        c1, n1 = time.process_time(), _cpu_s(node_pid)
        per = 1e6 / BATCH
        blocks = CONTROL_ROUNDS * BATCH
        out[name] = (min(times) * per, statistics.median(times) * per, (c1 - c0) * 1e6 / blocks,
                     (n1 - n0) * 1e6 / blocks)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per side (default: 9 at 256 KiB, 3 at 4 MiB)")
    ap.add_argument("--no-pin", action="store_true", help="leave CPU placement to the scheduler")
    args = ap.parse_args()
    from quillcache import Client
    # 1 GiB per 4 MiB batch, and a replacement needs a free slot before the old one goes
    with LocalNode(dram="3GiB", max_block="8MiB") as node:
        placement = _pin(node.proc.pid, not args.no_pin)
        with Client(node.tcp, timeout=120) as tcp, Client(node.unix, timeout=120) as uni:
            if not uni.shm:
                raise SystemExit(f"the Unix client did not map the arena: {uni.shm_refused}")
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"local_path: batches of {BATCH}, one DRAM-only node, {placement}; load average {load}")
            results = {}
            for size in SIZES:
                results[size] = run_size(tcp, uni, size, args.rounds or ROUNDS[size])
            control = control_cost(uni, node.proc.pid)
    names = ["get tcp", "get unix memcpy", "get located copy", "get located read",
             "put tcp", "put unix memcpy", "put reserved"]
    print(f"\n| side | {' | '.join(f'{s // KiB} KiB MB/s | x tcp' for s in SIZES)} |")
    print("|---|" + "---|---|" * len(SIZES))
    for name in names:
        base = "get tcp" if name.startswith("get") else "put tcp"
        cells = []
        for size in SIZES:
            r = results[size]
            cells.append(f"{r[name] / MiB:,.0f} | {r[name] / r[base]:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")
    r = results[256 * KiB]
    get_ratio = r["get unix memcpy"] / r["get tcp"]
    put_ratio = r["put unix memcpy"] / r["put tcp"]
    print("\n| control, per block | best us | median us | client CPU us | node CPU us | target us |")
    print("|---|---|---|---|---|---|")
    targets = {"GET_LOCATED+RELEASE": TARGET_GET_CONTROL_US, "RESERVE+COMMIT": TARGET_PUT_CONTROL_US}
    for name, (best, med, ccpu, ncpu) in control.items():
        print(f"| {name} | {best:.2f} | {med:.2f} | {ccpu:.2f} | {ncpu:.2f} | {targets.get(name, '-')} |")
    control_met = all(control[n][0] <= t for n, t in targets.items())
    print(f"\ntarget: unix GET of {BATCH} x 256 KiB = {get_ratio:.2f}x TCP, PUT {put_ratio:.2f}x "
          f"(target >= {TARGET_GET_RATIO}x): {'met' if min(get_ratio, put_ratio) >= TARGET_GET_RATIO else 'NOT met'}; "
          f"control (best of {CONTROL_ROUNDS}) {'met' if control_met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
