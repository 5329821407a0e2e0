"""asv suite: WAL group commit, framing cost and recovery reads.

Absolute times on a shared machine are noise; compare runs of one machine.
The standalone comparison against a raw pwritev loop is bench/wal.py.
"""
import os
import shutil
import tempfile

BATCH = 16  # records per commit


def _backends():
    from quillcache._native import wal

    return ["pwritev", "uring"] if wal.HAVE_LIBURING else ["pwritev"]


class WalGroupCommit:
    """Append BATCH records then commit (one vectored write + linked fdatasync)."""

    params = ([4096, 65536, 1 << 20], _backends())
    param_names = ["record_bytes", "backend"]
    timeout = 120

    def setup(self, record_bytes, backend):
        from quillcache._native import wal

        self.dir = tempfile.mkdtemp(prefix="qc-asv-wal-")
        self.w = wal.WalWriter(self.dir, backend=backend)
        self.payload = os.urandom(record_bytes)

    def teardown(self, record_bytes, backend):
        self.w.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_append_batch_and_commit(self, record_bytes, backend):
        append = self.w.append
        for _ in range(BATCH):
            append(self.payload)
        self.w.commit()


class WalAppend:
    """Framing (copy + CRC32C into the pending buffer).  The log lives on tmpfs when there is
    one, so the commit every 8 MiB that keeps the pending buffer bounded costs a memcpy, not
    a disk flush."""

    params = [64, 4096, 65536, 1 << 20]
    param_names = ["record_bytes"]

    def setup(self, record_bytes):
        from quillcache._native import wal

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = tempfile.mkdtemp(prefix="qc-asv-wal-", dir=shm)
        self.w = wal.WalWriter(self.dir, backend="pwritev")
        self.payload = os.urandom(record_bytes)
        self.limit = 8 << 20  # bytes of pending records before a commit

    def teardown(self, record_bytes):
        self.w.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_append(self, record_bytes):
        if self.w.pending_bytes > self.limit:
            self.w.commit()
        self.w.append(self.payload)


class WalRecoveryRead:
    """Reading a 32 MiB log back (what a restart does)."""

    params = [4096, 65536]
    param_names = ["record_bytes"]
    timeout = 120

    def setup(self, record_bytes):
        from quillcache._native import wal

        self.dir = tempfile.mkdtemp(prefix="qc-asv-wal-")
        payload = os.urandom(record_bytes)
        with wal.WalWriter(self.dir, backend="pwritev") as w:
            for _ in range((32 << 20) // record_bytes):
                w.append(payload)
            w.commit()

    def teardown(self, record_bytes):
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_read_all(self, record_bytes):
        from quillcache._native import wal

        for _ in wal.WalReader(self.dir):
            pass
