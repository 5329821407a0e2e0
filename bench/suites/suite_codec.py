"""asv suite: the frame codec (quillcache._native.codec).

  small frames   GET requests (an ~80-byte key) fed in 64 KiB chunks: frames/s
  big payloads   4 MiB PUT frames received through get_buffer/buffer_updated straight
                 into a destination (the copy into the view stands for the kernel's recv)
  encoder        encode_frame_header for a GET
  crc32c         the codec's CRC32C (libcrc32c through a C pointer when found, else its own
                 slicing-by-8 table) next to the table code and google_crc32c's Python API
  key cache      the node's decoded keys (node.keys.KeyCache): 32,768 keys through its 16,384,
                 every one a miss (bench/key_cache.py has the ratios against its baselines)

Standalone: ``.venv/bin/python bench/suites/suite_codec.py`` prints the numbers.
"""
import os
import time

from quillcache._native.codec import (
    CRC32C_IMPL, EV_NEED_DATA, FLAG_PAYLOAD_CRC, EV_PAYLOAD_START, FrameParser, _crc32c_portable, crc32c,
    encode_frame_header,
)
from quillcache.model import KvBlockKey, encode_key
from quillcache.protocol import messages
from quillcache.protocol.opcodes import KNOWN_FLAGS, REQUEST_OPCODES, Opcode

SMALL_FRAMES = 20_000        # frames per timed small-frame parse
CHUNK = 65536                # bytes per feed() / recv
BIG_PAYLOAD = 4 << 20        # bytes per big frame
BIG_FRAMES = 16              # frames per timed big-payload parse
_OPS = sorted(int(o) for o in REQUEST_OPCODES)


def _parser():
    return FrameParser(_OPS, max_header_bytes=1 << 20, max_payload_bytes=64 << 20, allowed_flags=KNOWN_FLAGS)


def _get_frame(i):
    key = encode_key(KvBlockKey("llama-3-8b-instruct", "llama3", None, "tenant-a", "root", f"{i:032x}", i))
    return encode_frame_header(Opcode.GET, i + 1, header=messages.encode_get_request(key))


def small_stream(n=SMALL_FRAMES):
    stream = b"".join(_get_frame(i) for i in range(n))
    return [stream[i:i + CHUNK] for i in range(0, len(stream), CHUNK)]


def parse_small(chunks):
    p = _parser()
    frames = 0
    for c in chunks:
        p.feed(c)
        while p.next_event() != EV_NEED_DATA:
            frames += 1
    return frames


def big_stream(n=BIG_FRAMES, payload_crc=False):
    payload = os.urandom(BIG_PAYLOAD)
    key = encode_key(KvBlockKey("m", "t", None, "x", "root", "b", 0))
    hdr = encode_frame_header(Opcode.PUT, 1, header=messages.encode_put_request(key, BIG_PAYLOAD),
                              payload_length=BIG_PAYLOAD, flags=FLAG_PAYLOAD_CRC if payload_crc else 0)
    trailer = crc32c(payload).to_bytes(4, "little") if payload_crc else b""
    return memoryview((hdr + payload + trailer) * n)


def parse_big(stream, dest):
    p = _parser()
    pos, end, done = 0, len(stream), 0
    while pos < end:
        view = p.get_buffer(-1)
        n = min(len(view), end - pos)   # a recv_into fills what it is given
        view[:n] = stream[pos:pos + n]
        p.buffer_updated(n)
        pos += n
        while (ev := p.next_event()) != EV_NEED_DATA:
            if ev == EV_PAYLOAD_START:
                p.set_destination(dest)
            else:
                done += 1
    return done


class SmallFrames:
    def setup(self):
        self.chunks = small_stream()

    def time_parse_20k_get_frames(self):
        parse_small(self.chunks)


class BigPayloads:
    def setup(self):
        self.stream = big_stream(4)
        self.dest = bytearray(BIG_PAYLOAD)

    def time_parse_4_frames_of_4mib_into_destination(self):
        parse_big(self.stream, self.dest)


class Encoder:
    def setup(self):
        key = encode_key(KvBlockKey("llama-3-8b-instruct", "llama3", None, "tenant-a", "root", "ab" * 16, 7))
        self.body = messages.encode_get_request(key)

    def time_encode_1k_get_headers(self):
        body = self.body
        for i in range(1, 1001):
            encode_frame_header(Opcode.GET, i, header=body)


class Crc:
    def setup(self):
        self.small = os.urandom(96)
        self.big = os.urandom(BIG_PAYLOAD)

    def time_crc32c_4mib(self):
        crc32c(self.big)

    def time_crc32c_96b_x1000(self):
        small = self.small
        for _ in range(1000):
            crc32c(small)


class KeyCacheMisses:
    def setup(self):
        self.raws = [encode_key(KvBlockKey("m", "tok", None, "t", "root", f"k{i}", i)) for i in range(32_768)]

    def time_decode_32k_misses(self):
        from quillcache.node.keys import KeyCache
        cache = KeyCache()
        decode = cache.decode
        for _ in range(2):                  # the second pass: every key a miss, the cache full
            for raw in self.raws:
                decode(raw)


def _best(fn, *args, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    import google_crc32c

    chunks = small_stream()
    t = _best(parse_small, chunks)
    nbytes = sum(len(c) for c in chunks)
    print(f"small frames: {SMALL_FRAMES / t:,.0f} frames/s ({nbytes // SMALL_FRAMES} B/frame, "
          f"{nbytes / t / 1e6:,.0f} MB/s)")

    stream = big_stream()
    dest = bytearray(BIG_PAYLOAD)
    t = _best(parse_big, stream, dest)
    print(f"4 MiB payloads via get_buffer/buffer_updated: {len(stream) / t / 1e6:,.0f} MB/s "
          f"({BIG_FRAMES / t:,.0f} frames/s)")
    stream_crc = big_stream(payload_crc=True)
    t = _best(parse_big, stream_crc, dest)
    print(f"  the same with FLAG_PAYLOAD_CRC checked: {len(stream_crc) / t / 1e6:,.0f} MB/s")
    copy = bytearray(len(stream))
    t_copy = _best(memoryview(copy).__setitem__, slice(None), stream)
    print(f"  (one plain copy of the same bytes: {len(stream) / t_copy / 1e6:,.0f} MB/s)")

    key = encode_key(KvBlockKey("llama-3-8b-instruct", "llama3", None, "tenant-a", "root", "ab" * 16, 7))
    body = messages.encode_get_request(key)
    t = _best(lambda: [encode_frame_header(Opcode.GET, i, header=body) for i in range(1, 100_001)])
    print(f"encode_frame_header: {100_000 / t:,.0f} headers/s")

    from quillcache.protocol.connection import ProtocolConnection

    class _Sink(ProtocolConnection):
        def _write(self, data):
            pass

        def _on_request(self, frame):
            self.reply_ok(frame.request_id, frame.opcode, b"", ())

    def through_connection(chunks):
        conn = _Sink(require_hello=False)
        for c in chunks:
            conn.data_received(c)

    t = _best(through_connection, chunks)
    print(f"small frames through ProtocolConnection with an empty reply each: {SMALL_FRAMES / t:,.0f} req/s")

    print(f"crc32c implementation: {CRC32C_IMPL}")
    big = os.urandom(BIG_PAYLOAD)
    t_own = _best(crc32c, big)
    t_tab = _best(_crc32c_portable, big)
    t_g = _best(google_crc32c.value, big)
    print(f"crc32c 4 MiB: codec {len(big) / t_own / 1e6:,.0f} MB/s, table {len(big) / t_tab / 1e6:,.0f} MB/s, "
          f"google_crc32c.value {len(big) / t_g / 1e6:,.0f} MB/s (codec/table speed-up {t_tab / t_own:.1f}x)")
    small = os.urandom(96)
    t_own = _best(lambda: [crc32c(small) for _ in range(100_000)])
    t_g = _best(lambda: [google_crc32c.value(small) for _ in range(100_000)])
    print(f"crc32c 96 B from Python: codec {t_own * 10:.3f} us/call, google_crc32c.value {t_g * 10:.3f} us/call")
