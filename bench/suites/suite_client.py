"""asv suite: a client against a real quillcached on this host (one node per setup).

  Located       the per-block control cost of the same-host path (docs/shm.md): a located GET
                and its RELEASE, and a RESERVE and its COMMIT, of BATCH blocks over the Unix
                socket with the arena mapped, the bytes not touched (bench/local_path.py
                prints the same figure per block, with the data paths beside it)
  BytesGet      ``get()`` (a new bytes object per block) against ``get_into`` (a caller's
                buffer), over TCP and over the Unix socket, small and large blocks
  ReceivePoll   single 1 KiB GETs over TCP from a client that polls before it sleeps
                (``spin_us`` 100, the default) and from one that sleeps at once (0)
"""
from ._node import ADDRESSES, OnNode, keys

BATCH = 64                   # blocks per located GET / reserved PUT
CONTROL_BYTES = 4096         # bytes per block of the control-cost batches
GETS = 16                    # GETs per timed call
POLL_BYTES = 1024            # bytes per block of the receive-poll comparison
SIZES = (4 << 10, 256 << 10)   # bytes per block of the bytes-API comparison


class Located(OnNode):
    """GET_LOCATED + RELEASE and RESERVE + COMMIT of BATCH blocks: divide by BATCH for the
    per-block control cost (target of issue 12: <= 3 us per block on the dev machine)."""

    timeout = 60

    def prepare(self):
        self.c = self.connect("unix")
        self.keys = keys("located", BATCH)
        self.c.put_many([(k, bytes([i]) * CONTROL_BYTES) for i, k in enumerate(self.keys)])
        self.put_items = [(k, CONTROL_BYTES) for k in keys("reserved", BATCH)]
        with self.c.get_many_located(self.keys) as views:
            if any(v is None or v[0] != i for i, v in enumerate(views)):
                raise RuntimeError("located GET: a block is missing or wrong")

    def time_located_get_release_64(self):
        with self.c.get_many_located(self.keys):
            pass

    def time_reserve_commit_64(self):
        with self.c.put_many_reserved(self.put_items):
            pass


class BytesGet(OnNode):
    """GETS blocks of one size: ``get`` returns new bytes, ``get_into`` fills a buffer the
    caller keeps (the bytes-API work: the two should cost the same on TCP, and ``get_into``
    less on the Unix socket, where it is one memcpy out of the arena)."""

    params = (list(ADDRESSES), list(SIZES))
    param_names = ["address", "block_bytes"]
    timeout = 60

    def prepare(self, address, block_bytes):
        self.c = self.connect(address)
        self.keys = keys(f"bytes-{block_bytes}", GETS)
        self.c.put_many([(k, bytes([i]) * block_bytes) for i, k in enumerate(self.keys)])
        self.buf = bytearray(block_bytes)
        for i, k in enumerate(self.keys):
            if self.c.get(k)[-1] != i or self.c.get_into(k, self.buf) != block_bytes or self.buf[-1] != i:
                raise RuntimeError("GET: wrong bytes")

    def time_get(self, address, block_bytes):
        get = self.c.get
        for k in self.keys:
            get(k)

    def time_get_into(self, address, block_bytes):
        get_into, buf = self.c.get_into, self.buf
        for k in self.keys:
            get_into(k, buf)


class ReceivePoll(OnNode):
    """GETS single GETs of a small block over TCP, the client polling its socket for up to
    ``spin_us`` before it sleeps, or sleeping at once (0): what the poll saves of a round trip
    (docs/protocol.md "Busy-polling receives"; bench/receive_poll.py prints the ratio)."""

    params = ([0.0, 100.0],)
    param_names = ["spin_us"]
    timeout = 60

    def prepare(self, spin_us):
        self.c = self.connect("tcp", spin_us=spin_us)
        self.keys = keys("poll", GETS)
        self.c.put_many([(k, bytes([i]) * POLL_BYTES) for i, k in enumerate(self.keys)])
        if any(self.c.get(k)[-1] != i for i, k in enumerate(self.keys)):
            raise RuntimeError("GET: wrong bytes")

    def time_get(self, spin_us):
        get = self.c.get
        for k in self.keys:
            get(k)
