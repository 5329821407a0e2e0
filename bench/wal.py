"""Group-commit throughput of the WAL against a raw pwritev + fdatasync loop.

For each record size, append ``--batch`` records then commit, repeated for
``--seconds``; the raw floor does os.pwritev + os.fdatasync of the same framed
bytes with the same batching (and the same segment rotation) in Python.  Both
backends (io_uring, pwritev) and the raw loop run interleaved in short rounds in
one process, so machine noise hits all three alike; the ratio is what matters.

    .venv/bin/python bench/wal.py [--dir /path/on/the/disk] [--seconds 1.5] [--batch 16]

All work happens in main() (asv imports only bench/suites/).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

SIZES = (4096, 65536, 1 << 20)
SEGMENT = 64 << 20  # bytes: the WAL's default segment size, mirrored by the raw loop


def _framed(payload, wal):
    """The exact bytes the WAL writes for ``payload`` at a block start (reference framing)."""
    import struct

    import google_crc32c

    out = bytearray()
    left, begin, off = payload, True, 0
    while True:
        if wal.WAL_BLOCK - off % wal.WAL_BLOCK < wal.WAL_HEADER:
            out += b"\0" * (wal.WAL_BLOCK - off % wal.WAL_BLOCK)
            off = 0
        avail = wal.WAL_BLOCK - off % wal.WAL_BLOCK - wal.WAL_HEADER
        frag, left = left[:avail], left[avail:]
        end = not left
        rtype = (wal.FULL if end else wal.FIRST) if begin else (wal.LAST if end else wal.MIDDLE)
        crc = google_crc32c.value(bytes([rtype]) + frag)
        crc = ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + wal.WAL_CRC_MASK_DELTA) & 0xFFFFFFFF
        out += struct.pack("<IHB", crc, len(frag), rtype) + frag
        off += wal.WAL_HEADER + len(frag)
        begin = False
        if end:
            return bytes(out)


class RawLog:
    """The floor: os.pwritev + os.fdatasync, rotating files like the WAL does."""

    def __init__(self, directory):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        self.seq = 0
        self.fd = -1
        self.off = 0
        self._rotate()

    def _rotate(self):
        if self.fd >= 0:
            os.close(self.fd)
        self.seq += 1
        self.fd = os.open(os.path.join(self.directory, "%012d.raw" % self.seq),
                          os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.off = 0
        os.fsync(self.dirfd)

    def commit(self, buffers, nbytes):
        if self.off + nbytes > SEGMENT:
            self._rotate()
        done = 0
        while done < nbytes:                     # pwritev may be short: continue
            n = os.pwritev(self.fd, buffers if done == 0 else [b"".join(buffers)[done:]],
                           self.off + done)
            done += n
        os.fdatasync(self.fd)
        self.off += nbytes

    def close(self):
        os.close(self.fd)
        os.close(self.dirfd)


def _round(kind, state, payload, framed, batch, seconds):
    """Run commits of one kind for ~seconds; return (commits, seconds taken)."""
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    if kind == "raw":
        raw = state
        buffers = [framed] * batch
        nbytes = len(framed) * batch
        while True:
            raw.commit(buffers, nbytes)
            n += 1
            if time.perf_counter() >= deadline:
                break
    else:
        w = state
        append, commit = w.append, w.commit
        while True:
            for _ in range(batch):
                append(payload)
            commit()
            n += 1
            if time.perf_counter() >= deadline:
                break
    return n, time.perf_counter() - t0


def bench_size(root, size, batch, seconds, rounds, kinds):
    from quillcache._native import wal

    payload = os.urandom(size)
    framed = _framed(payload, wal)
    states = {}
    totals = {k: [0, 0.0] for k in kinds}
    try:
        for k in kinds:
            d = os.path.join(root, f"{k}-{size}")
            states[k] = RawLog(d) if k == "raw" else wal.WalWriter(d, backend=k)
        for _ in range(rounds):
            for k in kinds:
                n, dt = _round(k, states[k], payload, framed, batch, seconds / rounds)
                totals[k][0] += n
                totals[k][1] += dt
    finally:
        for k, s in states.items():
            s.close()
            shutil.rmtree(os.path.join(root, f"{k}-{size}"), ignore_errors=True)
    out = {}
    for k, (n, dt) in totals.items():
        out[k] = {"commits_s": n / dt, "mb_s": n * batch * size / dt / 1e6}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir in /tmp)")
    ap.add_argument("--seconds", type=float, default=1.5, help="seconds per size and kind")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    ap.add_argument("--batch", type=int, default=16, help="records appended per commit")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="record sizes in bytes")
    args = ap.parse_args(argv)

    from quillcache._native import wal

    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = ["raw", "pwritev"] + (["uring"] if wal.HAVE_LIBURING else [])
    root = tempfile.mkdtemp(prefix="qc-walbench-", dir=args.dir or "/tmp")
    print(f"# WAL group commit: batch={args.batch} records/commit, {args.seconds}s per size and kind, "
          f"dir={root}")
    print(f"# crc32c: {wal.CRC32C_IMPL}; liburing built in: {wal.HAVE_LIBURING}")
    hdr = f"{'size':>8} {'kind':>8} {'MB/s':>9} {'commits/s':>10} {'vs raw':>7}"
    print(hdr)
    try:
        for size in sizes:
            res = bench_size(root, size, args.batch, args.seconds, args.rounds, kinds)
            for k in kinds:
                r = res[k]
                ratio = r["mb_s"] / res["raw"]["mb_s"]
                name = {"uring": "io_uring"}.get(k, k)
                print(f"{size:>8} {name:>8} {r['mb_s']:>9.1f} {r['commits_s']:>10.1f} {ratio:>6.2f}x")
            if "uring" in res:
                print(f"{size:>8} io_uring/pwritev throughput: "
                      f"{res['uring']['mb_s'] / res['pwritev']['mb_s']:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
