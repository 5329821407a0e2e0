"""What the bytes alone cost a cross-node read on this host: one NIXL READ and the reader's CRC
(issue 25).

    .venv/bin/python bench/nixl_ceiling.py [--reps 200] [--json]

A cross-node GET at a reader does all a local GET does (take the request, send the bytes to its
client) and, besides, moves the bytes from the holder into its own memory and checks them
against the CRC32C their writer recorded.  On an RDMA fabric the NIC moves them; where NIXL
stands in for one on a single host (UCX's default transports: shared memory and CMA), the
reader's CPU copies them (``process_vm_readv``).  This measures those two costs with nothing of
QuillCache's around them:

* two processes: a holder agent with a node's DRAM arena of 256 MiB registered (``DramTier``,
  the memfd a node maps, prefaulted; ``--hugepages`` as ``[store] hugepages = true``), filled
  with random bytes so each read finds them out of cache, as a pool's blocks are, and a reader
  agent with a registered staging area; one NIXL READ per GET (1 x 256 KiB, 1 x 4 MiB, and 64 x 256 KiB in one transfer for
  GET_MANY), each at a new offset, timed from ``initialize_xfer`` to ``DONE``;
* the reader's CRC32C of the bytes read (``quillcache._native.crc.crc32c``, what
  cluster/reads.py checks each block with);
* the baseline, in the same run: a memcpy (numpy) of the same bytes from the same cold region.

``bench/cluster_transport.py`` runs this beside its pools and prints, for each row, the best
cross-node / local ratio these costs leave: local / (local + READ + CRC), with local the
same run's local GET.  It bounds a reader that does the READ, the check and the send one after
the other, as a node's loop does; only a reader that overlapped them on cores of its own could
pass it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

REGION = 256 << 20                  # bytes the holder registers by default: past the last-level cache
BLOCK = 256 << 10
CASES = (("GET 256 KiB", BLOCK, 1), ("GET 4 MiB", 4 << 20, 1), ("GET_MANY 64 x 256 KiB", BLOCK, 64))


def _api():
    import importlib

    from quillcache.transfer.nixl import NIXL_MODULE
    return importlib.import_module(NIXL_MODULE)


def _agent(api, name: str, progress: bool):
    """An agent made as a node makes its own (transfer/nixl.py): the holder's with a progress thread
    that sleeps between rounds (NIXL's default spins a core, which would slow the reader on a
    small host), the reader's with none."""
    from quillcache.transfer.nixl import make_agent
    return make_agent(api, name, progress=progress)


def _holder(to_reader, from_reader, hugepages: bool, region_bytes: int) -> None:
    from quillcache.store.dram import DramTier
    api = _api()
    agent = _agent(api, "ceiling-holder", True)
    arena = DramTier(region_bytes, hugepages=hugepages, prefault=True)     # a node's arena, as it maps it
    region = arena.array
    for at in range(0, region_bytes, 16 << 20):
        n = min(16 << 20, region_bytes - at)
        region[at:at + n] = np.frombuffer(os.urandom(n), np.uint8)
    agent.register_memory([(region.ctypes.data, region_bytes, 0, "")], "DRAM")
    to_reader.put((agent.get_agent_metadata(), region.ctypes.data, arena.backing))
    from_reader.get()                   # the reader is done
    os._exit(0)                         # past NIXL 1.5.1's crashing ELF destructors (transfer/nixl.py)


def measure(reps: int, hugepages: bool = False, region_bytes: int = REGION) -> tuple[str, dict[str, dict[str, float]]]:
    """The holder arena's backing, and per case: p50 microseconds of the READ, of the CRC and of
    the memcpy baseline."""
    from quillcache._native.crc import crc32c

    ctx = mp.get_context("spawn")
    to_reader, from_reader = ctx.Queue(), ctx.Queue()
    holder = ctx.Process(target=_holder, args=(to_reader, from_reader, hugepages, region_bytes),
                         daemon=True)
    holder.start()
    try:
        meta, remote, backing = to_reader.get(timeout=120)
        api = _api()
        agent = _agent(api, "ceiling-reader", False)
        staging = np.zeros(64 * BLOCK + (4 << 20), np.uint8)
        agent.register_memory([(staging.ctypes.data, staging.nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(meta)
        cold = np.frombuffer(os.urandom(region_bytes), np.uint8).copy()   # the memcpy's source, as cold
        out: dict[str, dict[str, float]] = {}
        at = 0
        for label, size, count in CASES:
            total = size * count
            reads, crcs, copies = [], [], []
            for rep in range(reps + 10):
                at = (at + total) % (region_bytes - total + 1)
                local = agent.get_xfer_descs([(staging.ctypes.data + j * size, size, 0) for j in range(count)],
                                             "DRAM")
                far = agent.get_xfer_descs([(remote + at + j * size, size, 0) for j in range(count)], "DRAM")
                t0 = time.perf_counter_ns()
                handle = agent.initialize_xfer("READ", local, far, peer)
                state = agent.transfer(handle)
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(handle)
                agent.release_xfer_handle(handle)
                t1 = time.perf_counter_ns()
                if state != "DONE":
                    raise SystemExit(f"{label}: the READ failed")
                view = memoryview(staging)
                for j in range(count):
                    crc32c(view[j * size:(j + 1) * size])
                t2 = time.perf_counter_ns()
                staging[:total] = cold[at:at + total]
                t3 = time.perf_counter_ns()
                if rep >= 10:                   # the first ones wire UCX up
                    reads.append(t1 - t0)
                    crcs.append(t2 - t1)
                    copies.append(t3 - t2)
            out[label] = {"bytes": total, "read_us": statistics.median(reads) / 1e3,
                          "crc_us": statistics.median(crcs) / 1e3, "memcpy_us": statistics.median(copies) / 1e3}
        return backing, out
    finally:
        from_reader.put(1)
        holder.join(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hugepages", action="store_true", help="the holder's arena as [store] hugepages = true maps it")
    ap.add_argument("--region-mib", type=int, default=REGION >> 20,
                    help="bytes read in turn (the working set): 256 MiB reads cold; bench/cluster_transport.py "
                         "reads 32-64 MiB in turn")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    args = ap.parse_args(argv)
    from quillcache.transfer.nixl import nixl_missing
    missing = nixl_missing()
    if missing:
        print(f"# skipped: {missing}")
        return 0
    if not 64 <= args.region_mib <= 4096:
        raise SystemExit("--region-mib: 64..4096 (the largest case reads 16 MiB at a time)")
    backing, got = measure(args.reps, args.hugepages, args.region_mib << 20)
    if args.json:
        print(json.dumps({"backing": backing, "cases": got}))
    else:
        print(f"UCX_TLS {os.environ.get('UCX_TLS') or 'default'}, the holder's arena {backing}, p50 of {args.reps}, "
              f"reading {args.region_mib} MiB in turn\n")
        print("| read | bytes | NIXL READ µs | GB/s | CRC32C µs | memcpy µs (baseline) | READ / memcpy |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, r in got.items():
            print(f"| {label} | {r['bytes']:,} | {r['read_us']:.1f} | {r['bytes'] / r['read_us'] / 1e3:.1f} | "
                  f"{r['crc_us']:.1f} | {r['memcpy_us']:.1f} | {r['read_us'] / r['memcpy_us']:.2f}x |")
    sys.stdout.flush()
    os._exit(0)                         # this process made agents: past the destructors that crash


if __name__ == "__main__":
    sys.exit(main())
