"""GETs sent from the SSD data file with sendfile, through a real quillcached.

A block only on the SSD tier, with ``[ssd] promote_on_get = false`` (or no DRAM room), is
sent from the data file: header by ``write``, payload by ``sendfile``, whatever the socket
does not take at once by ``preadv`` through the transport, and the stored CRC32C as the
payload CRC trailer.  These tests check the bytes, the order of pipelined replies when the
socket fills in the middle of a sendfile, that a block rotting on disk after its first
check is caught by the client instead of used, and the reloadable switch.
"""
from __future__ import annotations

import asyncio
import mmap
import os
import random
import signal
import struct
import threading
import time

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache._native.crc import crc32c
from quillcache.client import AsyncClient
from quillcache.errors import NotFound, ProtocolError
from quillcache.model import encode_key
from quillcache.protocol import messages
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, Opcode
from tests._support.daemon import Daemon
from tests._support.data import content, key
from tests._support.net import raw_connect, read_frames

MiB = 1 << 20
SIZES = (1, 4095, 4096, 65537, MiB, 3 * MiB + 7)


def _sections(promote: bool, sendfile: bool = True) -> dict[str, str]:
    return {"store": 'policy = "write_through"',
            "ssd": f"promote_on_get = {str(promote).lower()}\nsendfile = {str(sendfile).lower()}",
            "limits": 'max_payload = "64MiB"'}


def _server(c: Client) -> dict:
    return c.info("Server")["Server"]


def _o_direct_works(directory) -> bool:
    probe = os.path.join(directory, "o_direct_probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)
        try:
            os.pwrite(fd, buf, 0)
            return True
        except OSError:
            return False
        finally:
            buf.close()
    finally:
        os.close(fd)
        os.unlink(probe)


def _restarted_with_ssd_only_blocks(tmp_path, blocks: dict, *, promote: bool = False,
                                    sendfile: bool = True, direct_io: bool = True) -> Daemon:
    """A stopped daemon whose blocks were put durably: started again (``with``), every block
    is on SSD only (recovered lazily: each is read and checked once before it can go by
    sendfile).  With ``direct_io`` (the only mode that sends by sendfile) the test is skipped
    where tmp_path's filesystem refuses O_DIRECT."""
    if direct_io and not _o_direct_works(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT (tmpfs?): no sendfile there")
    d = Daemon(tmp_path, ssd=True, sections=_sections(promote, sendfile), max_block="16MiB",
               direct_io=direct_io).start()
    with Client(d.addr) as c:
        for k, v in blocks.items():
            c.put(k, v, durable=True)
    assert d.stop() == 0
    return d


def test_ssd_only_blocks_go_by_sendfile_byte_for_byte_and_dram_stays_empty(tmp_path):
    blocks = {key(i): content(i, n) for i, n in enumerate(SIZES)}
    with _restarted_with_ssd_only_blocks(tmp_path, blocks) as d, Client(d.addr) as c:
        for k, v in blocks.items():                   # first read: preadv + CRC check (verifies)
            assert c.get(k) == v
        assert _server(c)["sendfile_bytes"] == 0
        for k, v in blocks.items():                   # then from the file
            assert c.get(k) == v
            buf = bytearray(len(v) + 3)
            assert c.get_into(k, buf) == len(v) and bytes(buf[:len(v)]) == v

        async def via_async():
            ac = await AsyncClient(d.addr).connect()
            try:
                got = await asyncio.gather(*(ac.get(k) for k in blocks))   # pipelined on one connection
            finally:
                await ac.close()
            return got
        assert asyncio.run(via_async()) == list(blocks.values())
        info = c.info()
        assert info["Server"]["sendfile_bytes"] == 3 * sum(SIZES)
        assert info["Tiers"]["ssd_extent_leases"] == 3 * len(SIZES)
        assert info["Tiers"]["dram_used"] == 0 and info["Tiers"]["ssd_promotions"] == 0
        assert info["Store"]["leases"] == 0


def test_a_reply_the_socket_cannot_take_at_once_is_finished_in_order_by_the_transport(tmp_path):
    big = {key(100 + i): content(100 + i, 12 * MiB + i) for i in range(4)}
    small = {key(200): content(200, 777)}
    with _restarted_with_ssd_only_blocks(tmp_path, big) as d, Client(d.addr) as c:
        for k, v in big.items():
            assert c.get(k) == v                      # verified: later GETs go from the file
        for k, v in small.items():
            c.put(k, v)                               # in DRAM: a view, between file replies
        before = _server(c)["sendfile_bytes"]
        s = raw_connect(d.port)
        order = [*big, *small, *big]
        want = {**big, **small}
        frames = b"".join(encode_frame_header(Opcode.GET, rid, header=messages.encode_get_request(encode_key(k)))
                          for rid, k in enumerate(order, 1))
        s.sendall(frames)
        time.sleep(0.5)              # the socket fills in the middle of the first sendfile
        replies = read_frames(s, len(order), timeout=30)
        s.close()
        assert [r.request_id for r in replies] == list(range(1, len(order) + 1))
        for r in replies:
            k = order[r.request_id - 1]
            assert r.status == 0 and bytes(r.payload) == want[k]
            assert bool(r.flags & FLAG_PAYLOAD_CRC) == (k in big)   # file replies carry the stored CRC
        sent = _server(c)["sendfile_bytes"] - before
        total = 2 * sum(len(v) for v in big.values())
        assert 0 < sent < total      # part went by sendfile, the rest through the transport


def test_a_block_that_rots_on_disk_after_its_check_is_caught_by_the_client_never_used(tmp_path):
    v = content(7, 256 * 1024)
    blocks = {key(7): v, key(8): content(8, 4096)}
    with _restarted_with_ssd_only_blocks(tmp_path, blocks) as d:
        with Client(d.addr) as c:
            assert c.get(key(7)) == v                 # checked once on the node
            data_file = d.data_dir / "ssd" / "blocks.dat"
            raw = data_file.read_bytes()
            at = raw.find(v)
            assert at >= 0 and raw.find(v, at + 1) < 0
            with open(data_file, "r+b") as f:         # the page cache the daemon reads now rots too
                f.seek(at + 1000)
                f.write(bytes([raw[at + 1000] ^ 0x40]))
            with pytest.raises(ProtocolError, match="(?i)crc"):
                c.get(key(7))
        with Client(d.addr) as c:                     # other blocks and connections are unaffected
            assert c.get(key(8)) == blocks[key(8)]
        s = raw_connect(d.port)                       # what the node sent: the rotten bytes with
        s.sendall(encode_frame_header(Opcode.GET, 1, header=messages.encode_get_request(encode_key(key(7)))))
        s.settimeout(10)
        data = b""
        while len(data) < 32 + len(v) + 4:
            chunk = s.recv(1 << 20)
            assert chunk
            data += chunk
        s.close()
        payload, trailer = data[32:32 + len(v)], data[32 + len(v):]
        assert payload != v and int.from_bytes(trailer, "little") == crc32c(v) != crc32c(payload)


def test_promote_on_get_is_reloadable(tmp_path):
    blocks = {key(i): content(i, 64 * 1024) for i in range(4)}
    with _restarted_with_ssd_only_blocks(tmp_path, blocks, promote=True) as d, Client(d.addr) as c:
        k0, k1, k2, _ = blocks
        assert c.get(k0) == blocks[k0] and c.get(k0) == blocks[k0]
        info = c.info()
        assert info["Tiers"]["ssd_promotions"] == 1 and info["Server"]["sendfile_bytes"] == 0
        d.write_config(ssd=True, sections=_sections(False), max_block="16MiB")
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while c.info("Store")["Store"]["promote_on_get"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.info("Store")["Store"]["promote_on_get"] == 0
        for _ in range(2):
            assert c.get(k1) == blocks[k1]
        info = c.info()
        assert info["Tiers"]["ssd_promotions"] == 1 and info["Server"]["sendfile_bytes"] == len(blocks[k1])
        assert c.get(k0) == blocks[k0]                # promoted earlier: still served from DRAM
        assert c.info("Server")["Server"]["sendfile_bytes"] == len(blocks[k1])


def test_with_sendfile_off_ssd_only_blocks_are_read_and_written_and_never_promoted(tmp_path):
    blocks = {key(i): content(i, n) for i, n in enumerate(SIZES)}
    with _restarted_with_ssd_only_blocks(tmp_path, blocks, sendfile=False) as d, Client(d.addr) as c:
        for _ in range(2):
            for k, v in blocks.items():
                assert c.get(k) == v
        info = c.info()
        assert info["Server"]["sendfile_bytes"] == 0 and info["Tiers"]["ssd_extent_leases"] == 0
        assert info["Tiers"]["dram_used"] == 0 and info["Tiers"]["ssd_promotions"] == 0
        assert info["Tiers"]["ssd_hits"] == 2 * len(SIZES)


def _recv_exactly(s, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(min(1 << 20, n - len(out)))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "o_direct"])
def test_a_reply_still_unread_keeps_its_bytes_when_the_extent_is_freed_and_rewritten(tmp_path, direct_io):
    """sendfile hands the socket page-cache pages, not copies: a buffered write into a reused
    extent would change a reply that still sits unread in the socket buffers (the client's
    CRC check would then fail the GET).  With O_DIRECT writes the kernel drops those pages
    from the cache and the reply keeps them; with buffered writes no extent goes by sendfile."""
    old, new = content(300, 12 * MiB), content(301, 12 * MiB)
    k_old, k_new = key(300), key(301)
    with _restarted_with_ssd_only_blocks(tmp_path, {k_old: old}, direct_io=direct_io) as d, Client(d.addr) as c:
        assert c.info("WAL")["WAL"]["direct_io"] == int(direct_io)
        assert c.get(k_old) == old                    # checked once: later GETs may go by sendfile
        data_file = d.data_dir / "ssd" / "blocks.dat"
        at = data_file.read_bytes().find(old[:4096])
        s = raw_connect(d.port)
        s.sendall(encode_frame_header(Opcode.GET, 1, header=messages.encode_get_request(encode_key(k_old))))
        time.sleep(0.5)                               # the reply fills the socket buffers, unread
        sent = _server(c)["sendfile_bytes"]
        assert (sent > 0) == direct_io                # sendfile only over O_DIRECT writes
        c.remove(k_old)
        c.put(k_new, new, durable=True)               # same size: the freed extent comes back
        assert data_file.read_bytes().find(new[:4096]) == at
        data = _recv_exactly(s, 32 + len(old) + (4 if direct_io else 0))   # a sendfile reply has a CRC trailer
        s.close()
        payload, trailer = data[32:32 + len(old)], data[32 + len(old):]
        assert payload == old
        if direct_io:
            assert int.from_bytes(trailer, "little") == crc32c(old)
        assert c.get(k_new) == new


CHURN_KEYS = 24
CHURN_SECONDS = 4.0
_VERSION = struct.Struct("<QQ")          # (key index, version) at the head of every churn block


def _churn_block(i: int, version: int) -> bytes:
    size = 256 * 1024 + i * 4099          # one size per key: an overwrite can take back the freed extent
    return _VERSION.pack(i, version) + content(i * 1_000_003 + version, size - _VERSION.size)


def test_sendfile_gets_under_overwrite_churn_read_only_whole_versions(tmp_path):
    """Readers GET SSD-only blocks (by sendfile) while writers overwrite the same keys with
    blocks of the same size, so freed extents are taken back at once: every reply must be
    one whole version of its key, byte for byte, and pass the client's CRC check."""
    blocks = {key(i, prefix="churn"): _churn_block(i, 0) for i in range(CHURN_KEYS)}
    d = _restarted_with_ssd_only_blocks(tmp_path, blocks)
    d.write_config(ssd=True, sections=_sections(False), dram="4MiB", max_block="1MiB")
    errors: list = []
    reads: list = []
    stop = threading.Event()

    def reader(n: int) -> None:
        rng = random.Random(n)
        count = 0
        try:
            with Client(d.addr, timeout=30) as c:
                while not stop.is_set():
                    i = rng.randrange(CHURN_KEYS)
                    try:
                        got = c.get(key(i, prefix="churn"))
                    except NotFound:
                        continue
                    gi, version = _VERSION.unpack_from(got)
                    if gi != i or got != _churn_block(i, version):
                        errors.append(f"key {i}: a reply that is no whole version (head says {gi} v{version})")
                    count += 1
        except Exception as exc:
            errors.append(f"reader {n}: {exc!r}")
        reads.append(count)

    def writer(n: int) -> None:
        rng = random.Random(100 + n)
        version = n
        try:
            with Client(d.addr, timeout=30) as c:
                while not stop.is_set():
                    version += 2                  # writer 0 even versions, writer 1 odd ones
                    i = rng.randrange(CHURN_KEYS)
                    c.put(key(i, prefix="churn"), _churn_block(i, version))
        except Exception as exc:
            errors.append(f"writer {n}: {exc!r}")

    with d:
        threads = [threading.Thread(target=reader, args=(n,)) for n in range(3)]
        threads += [threading.Thread(target=writer, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        time.sleep(CHURN_SECONDS)
        stop.set()
        for t in threads:
            t.join(60)
        with Client(d.addr) as c:
            info = c.info()
    assert not errors, errors[:5]
    assert sum(reads) > 50
    assert info["Server"]["sendfile_bytes"] > 0 and info["Tiers"]["ssd_extent_leases"] > 0
