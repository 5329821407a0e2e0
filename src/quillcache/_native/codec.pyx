"""The QuillCache frame codec: a parser state machine and a header encoder, no I/O.

Wire format (docs/protocol.md has the prose spec); all integers little-endian::

    off size field
      0    2 magic           b"QC"
      2    1 version         1
      3    1 opcode
      4    2 flags           FLAG_REPLY | FLAG_PAYLOAD_CRC | opcode flags
      6    2 status          0 except in ERROR replies
      8    8 request_id      != 0 except in a connection-level ERROR reply
     16    8 payload_length  bytes of payload after the header (trailer excluded)
     24    4 header_length   bytes of variable header
     28    H header          header_length bytes
   28+H    4 header_crc      CRC32C of bytes [0, 28+H)
   32+H    P payload         payload_length bytes (not covered by header_crc)
 32+H+P    4 payload_crc     CRC32C of the payload, only with FLAG_PAYLOAD_CRC

The parser is fed either with ``feed(data)`` (data_received) or through
``get_buffer(sizehint)`` / ``buffer_updated(n)`` (asyncio.BufferedProtocol); the
consumer then calls ``next_event()`` until it returns ``EV_NEED_DATA``.  After
``EV_PAYLOAD_START`` the consumer may hand the parser a destination for the
payload (``set_destination``), receive it into a new ``bytes`` (``receive_bytes``), ask
for it in chunks (``stream_payload``), throw it away (``discard_payload``) or do nothing:
then it is collected into a bytearray.
A malformed frame raises ``MalformedFrame`` (a ``ProtocolError``, status 7) and the
parser stays failed: every later call raises the same error.
"""
from cpython.buffer cimport PyBUF_FULL_RO, PyBUF_SIMPLE, PyBuffer_FillInfo, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memmove

from quillcache.errors import InvalidArgument, ProtocolError

__all__ = [
    "Frame", "FrameParser", "MalformedFrame", "encode_frame_header", "crc32c",
    "MAGIC", "PROTOCOL_VERSION", "FIXED_PREFIX_SIZE", "CRC_SIZE", "FRAME_OVERHEAD",
    "FLAG_REPLY", "FLAG_PAYLOAD_CRC", "OP_ERROR", "MAX_REQUEST_ID",
    "EV_NEED_DATA", "EV_FRAME", "EV_PAYLOAD_START", "EV_PAYLOAD_CHUNK", "EV_PAYLOAD_END",
    "REASONS", "CRC32C_IMPL",
    "encode_key_body", "decode_key_body", "decode_key_field", "decode_key_list", "encode_put_body",
    "decode_put_body", "uninitialised_bytearray", "total_nbytes", "encode_key_list", "encode_sized_key_list",
    "decode_sized_key_list", "encode_located_items", "first_bad_located_item", "located_views",
    "release_views", "first_slot_outside", "slot_views", "encode_status_sizes", "decode_status_sizes",
]

# ----------------------------------------------------------------------------- constants

cdef enum:
    _MAGIC0 = 0x51          # 'Q'
    _MAGIC1 = 0x43          # 'C'
    _VERSION = 1
    _FIXED = 28
    _CRC = 4
    _FLAG_REPLY = 0x0001
    _FLAG_PAYLOAD_CRC = 0x0002
    _OP_ERROR = 0xFF
    DEFAULT_READ_CHUNK = 65536      # bytes offered by get_buffer() between payloads
    MIN_READ_ROOM = 4096            # bytes: compact/grow the buffer when less is free
    DIRECT_MIN = 32768              # bytes: a destination segment with less left than this, and
                                    # more payload after it, is received through the internal
                                    # buffer (one recv for many small values, then memcpy)
    _EV_NEED = 0
    _EV_FRAME = 1
    _EV_START = 2
    _EV_CHUNK = 3
    _EV_END = 4
    ST_HEADER = 0
    ST_PAYLOAD = 1
    ST_TRAILER = 2
    ST_FAILED = 3
    M_UNSET = 0
    M_DEST = 1
    M_DISCARD = 2
    M_STREAM = 3
    GB_NONE = 0
    GB_INTERNAL = 1
    GB_DEST = 2


MAGIC = b"QC"
PROTOCOL_VERSION = 1
FIXED_PREFIX_SIZE = 28      # bytes before the variable header
CRC_SIZE = 4                # bytes of a CRC32C field
FRAME_OVERHEAD = 32         # bytes of a frame with an empty header and no payload
FLAG_REPLY = 0x0001         # the frame is a reply (echoes the request id)
FLAG_PAYLOAD_CRC = 0x0002   # a CRC32C trailer follows the payload
OP_ERROR = 0xFF             # the ERROR reply; the only frame with a non-zero status
MAX_REQUEST_ID = (1 << 64) - 1


EV_NEED_DATA = 0        # nothing more until more bytes arrive
EV_FRAME = 1            # a complete frame without payload phase: parser.frame
EV_PAYLOAD_START = 2    # header parsed, payload follows: choose where it goes now
EV_PAYLOAD_CHUNK = 3    # stream mode: parser.chunk holds the next payload bytes
EV_PAYLOAD_END = 4      # the payload is complete (and its trailer CRC verified)




REASONS = (
    "bad_magic", "bad_version", "unknown_opcode", "bad_flags", "bad_status",
    "bad_request_id", "header_too_long", "payload_too_large", "bad_header_crc",
    "bad_payload_crc",
)


class MalformedFrame(ProtocolError):
    """A frame that breaks the format or a limit.  ``reason`` is one of ``REASONS``,
    ``offset`` the stream offset of the frame's first byte.  The parser that raised
    it is failed for good; the connection replies ERROR and closes."""

    def __init__(self, reason, message, offset=0):
        self.reason = reason
        self.offset = offset
        super().__init__(f"{reason}: {message} (frame at stream offset {offset})")


# ----------------------------------------------------------------------------- CRC32C

# crc32c_update comes from quillcache._native.crc (cimported in codec.pxd); the Python
# names stay here for the codec's users.  _crc32c_portable: the table code, for tests.
from quillcache._native.crc import CRC32C_IMPL, crc32c, crc32c_table as _crc32c_portable


# ----------------------------------------------------------------------------- little-endian fields

cdef inline uint16_t _get16(const unsigned char* p) noexcept nogil:
    return <uint16_t>(p[0] | (<uint16_t>p[1] << 8))


cdef inline uint32_t _get32(const unsigned char* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _get64(const unsigned char* p) noexcept nogil:
    return <uint64_t>_get32(p) | (<uint64_t>_get32(p + 4) << 32)


cdef inline void _put16(unsigned char* p, uint16_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = v >> 8


cdef inline void _put32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = v >> 24


cdef inline void _put64(unsigned char* p, uint64_t v) noexcept nogil:
    _put32(p, <uint32_t>v)
    _put32(p + 4, <uint32_t>(v >> 32))


# ----------------------------------------------------------------------------- encoder

def encode_frame_header(opcode, request_id, *, flags=0, header=b"", payload_length=0,
                        status=0, max_header_bytes=None):
    """The fixed header, the variable ``header`` body and the header CRC as one ``bytes``.

    The payload (and, with ``FLAG_PAYLOAD_CRC``, its 4-byte trailer from
    ``crc32c``) is sent separately: writelines([frame_header, *payload_views]).
    Raises ``InvalidArgument`` for out-of-range fields; nothing is allocated before.
    """
    cdef Py_buffer hv
    cdef Py_ssize_t hlen, total
    cdef unsigned char* p
    cdef bytes out
    if not isinstance(opcode, int) or not 0 <= opcode <= 0xFF:
        raise InvalidArgument(f"opcode {opcode!r}: must be an integer in 0..255")
    if not isinstance(request_id, int) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise InvalidArgument(f"request_id {request_id!r}: must be an integer in 0..2**64-1")
    if not isinstance(flags, int) or not 0 <= flags <= 0xFFFF:
        raise InvalidArgument(f"flags {flags!r}: must be an integer in 0..0xFFFF")
    if not isinstance(status, int) or not 0 <= status <= 0xFFFF:
        raise InvalidArgument(f"status {status!r}: must be an integer in 0..0xFFFF")
    if not isinstance(payload_length, int) or not 0 <= payload_length <= MAX_REQUEST_ID:
        raise InvalidArgument(f"payload_length {payload_length!r}: must be an integer in 0..2**64-1")
    PyObject_GetBuffer(header, &hv, PyBUF_SIMPLE)
    try:
        hlen = hv.len
        if hlen > 0xFFFFFFFF or (max_header_bytes is not None and hlen > max_header_bytes):
            limit = 0xFFFFFFFF if max_header_bytes is None else max_header_bytes
            raise InvalidArgument(f"header body is {hlen} bytes: at most {limit}")
        total = _FIXED + hlen + _CRC
        out = PyBytes_FromStringAndSize(NULL, total)
        p = <unsigned char*>PyBytes_AS_STRING(out)
        p[0] = _MAGIC0
        p[1] = _MAGIC1
        p[2] = _VERSION
        p[3] = <unsigned char>opcode
        _put16(p + 4, <uint16_t>flags)
        _put16(p + 6, <uint16_t>status)
        _put64(p + 8, <uint64_t>request_id)
        _put64(p + 16, <uint64_t>payload_length)
        _put32(p + 24, <uint32_t>hlen)
        if hlen:
            memcpy(p + _FIXED, hv.buf, hlen)
        _put32(p + _FIXED + hlen, crc32c_update(0, p, <size_t>(_FIXED + hlen)))
    finally:
        PyBuffer_Release(&hv)
    return out


# ----------------------------------------------------------------------------- request bodies

include "codec_bodies.pxi"
include "codec_located.pxi"


# ----------------------------------------------------------------------------- frames

cdef class Frame:
    """One parsed frame.  ``payload`` is set when the payload phase ends: the collected
    bytearray, the destination view(s) trimmed to the payload, or None (no payload,
    discarded, streamed)."""

    @property
    def is_reply(self):
        return bool(self.flags & _FLAG_REPLY)

    @property
    def has_payload_crc(self):
        return bool(self.flags & _FLAG_PAYLOAD_CRC)

    def __repr__(self):
        return (f"Frame(opcode={self.opcode:#04x}, flags={self.flags:#06x}, status={self.status}, "
                f"request_id={self.request_id}, header={len(self.header)}B, "
                f"payload_length={self.payload_length})")


def uninitialised_bytearray(Py_ssize_t n):
    """A ``bytearray`` of ``n`` bytes whose contents are whatever the allocator returned (no
    zero fill): for a buffer that is received into before anyone reads it."""
    if n < 0:
        raise InvalidArgument(f"size {n}: must be >= 0")
    return PyByteArray_FromStringAndSize(NULL, n)


def total_nbytes(list parts not None):
    """The bytes in ``parts`` (``bytes`` or any buffer: a memoryview of any format counts
    its ``nbytes``), what a ``writelines(parts)`` hands the transport."""
    cdef Py_ssize_t total = 0
    cdef Py_buffer v
    for o in parts:
        if type(o) is bytes:
            total += PyBytes_GET_SIZE(o)
        else:
            PyObject_GetBuffer(o, &v, PyBUF_FULL_RO)
            total += v.len
            PyBuffer_Release(&v)
    return total


cdef class _BytesFill:
    """A writable buffer over a ``bytes`` object that nobody else has seen yet: the parser
    receives a payload into it (``receive_bytes``), then hands the ``bytes`` out.  Holds the
    ``bytes`` alive for as long as a view of it exists."""

    cdef bytes _b

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, PyBytes_AS_STRING(self._b), len(self._b), 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass


def _as_byte_view(obj):
    """A writable, C-contiguous, 1-D unsigned-byte memoryview over ``obj``."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgument(f"destination {type(obj).__name__} does not support the buffer protocol") from None
    if mv.readonly:
        raise InvalidArgument("destination buffer is read-only")
    if not mv.c_contiguous:
        raise InvalidArgument("destination buffer is not C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


cdef class FrameParser:
    """Incremental frame parser (see the module docstring for the protocol with the consumer).

    ``opcodes``: the opcodes accepted (``OP_ERROR`` is added on the reply side).
    ``allowed_flags``: flag bits that may be set (``FLAG_REPLY`` and
    ``FLAG_PAYLOAD_CRC`` are always understood).  ``replies``: parse replies
    (client side) instead of requests (server side).
    """

    def __cinit__(self):
        self._in_held = False

    def __init__(self, opcodes, *, uint64_t max_header_bytes, uint64_t max_payload_bytes,
                 bint replies=False, int allowed_flags=0xFFFF, Py_ssize_t read_chunk=DEFAULT_READ_CHUNK):
        cdef int op
        if max_header_bytes > 0xFFFFFFFF:
            raise InvalidArgument(f"max_header_bytes {max_header_bytes}: the field is 32 bits")
        if read_chunk < MIN_READ_ROOM:
            raise InvalidArgument(f"read_chunk {read_chunk}: at least {MIN_READ_ROOM} bytes")
        if not 0 <= allowed_flags <= 0xFFFF:
            raise InvalidArgument(f"allowed_flags {allowed_flags:#x}: 16 bits")
        for op in range(256):
            self._opcodes[op] = 0
        for op in opcodes:
            if not 0 <= op <= 0xFF:
                raise InvalidArgument(f"opcode {op}: must be in 0..255")
            self._opcodes[op] = 1
        if replies:
            self._opcodes[_OP_ERROR] = 1
        else:
            self._opcodes[_OP_ERROR] = 0    # clients never send ERROR
        self._max_header = max_header_bytes
        self._max_payload = max_payload_bytes
        self._replies = replies
        self._allowed_flags = <uint16_t>(allowed_flags | _FLAG_REPLY | _FLAG_PAYLOAD_CRC)
        self._read_chunk = read_chunk
        self._buf = bytearray(read_chunk)
        self._start = 0
        self._end = 0
        self._in_pos = 0
        self._state = ST_HEADER
        self._have_fixed = False
        self._consumed = 0
        self._mode = M_UNSET
        self._gb_kind = GB_NONE
        self._error = None

    def __dealloc__(self):
        self._release_input()

    def set_limits(self, *, uint64_t max_header_bytes, uint64_t max_payload_bytes, Py_ssize_t read_chunk=-1):
        """Change the limits for the frames that follow (a server raises them once a client
        logged in).  ``read_chunk`` (-1: unchanged) is what ``get_buffer`` offers between
        payloads; a larger one replaces the internal buffer now, its live bytes kept.  Only
        between events: not between ``get_buffer`` and ``buffer_updated``, nor while a frame
        is half parsed (the limits of a frame are those it was admitted under)."""
        cdef bytearray nb
        cdef Py_ssize_t live
        if max_header_bytes > 0xFFFFFFFF:
            raise InvalidArgument(f"max_header_bytes {max_header_bytes}: the field is 32 bits")
        if read_chunk != -1 and read_chunk < MIN_READ_ROOM:
            raise InvalidArgument(f"read_chunk {read_chunk}: at least {MIN_READ_ROOM} bytes")
        if self._gb_kind != GB_NONE:
            raise RuntimeError("set_limits() between get_buffer() and buffer_updated()")
        if self._have_fixed or self._state != ST_HEADER:
            raise RuntimeError("set_limits() in the middle of a frame")
        self._max_header = max_header_bytes
        self._max_payload = max_payload_bytes
        if read_chunk == -1:
            return
        self._read_chunk = read_chunk
        if len(self._buf) < read_chunk:
            live = self._end - self._start
            nb = bytearray(read_chunk)
            if live:
                memcpy(PyByteArray_AS_STRING(nb), PyByteArray_AS_STRING(self._buf) + self._start, live)
            self._buf = nb
            self._start = 0
            self._end = live

    @property
    def limits(self):
        """``(max_header_bytes, max_payload_bytes, read_chunk)`` now in force."""
        return (self._max_header, self._max_payload, self._read_chunk)

    # ------------------------------------------------------------------ introspection

    @property
    def frame(self):
        """The frame of the last event."""
        return self._frame

    @property
    def chunk(self):
        """The payload bytes of the last ``EV_PAYLOAD_CHUNK``."""
        return self._chunk

    @property
    def failed(self):
        return self._state == ST_FAILED

    @property
    def error(self):
        return self._error

    @property
    def in_payload(self):
        return self._state == ST_PAYLOAD or self._state == ST_TRAILER

    @property
    def payload_remaining(self):
        return self._remaining if self._state == ST_PAYLOAD else 0

    @property
    def buffered(self):
        """Bytes received and not yet consumed by ``next_event``."""
        cdef Py_ssize_t n = self._end - self._start
        if self._in_held:
            n += self._in_view.len - self._in_pos
        return n

    @property
    def buffer_capacity(self):
        return len(self._buf)

    @property
    def stream_offset(self):
        return self._consumed

    # ------------------------------------------------------------------ failure

    cdef int _fail(self, str reason, str message) except -1:
        cdef uint64_t offset = self._consumed
        if (self._state == ST_PAYLOAD or self._state == ST_TRAILER) and self._frame is not None:
            offset = self._frame.offset     # a payload error belongs to the frame it is in
        self._error = MalformedFrame(reason, message, offset)
        self._state = ST_FAILED
        self._release_input()
        self._segs = None
        self._seg_obj = None
        self._seg_ptr = NULL
        self._dest_result = None
        raise self._error

    cdef inline int _check_alive(self) except -1:
        if self._state == ST_FAILED:
            raise self._error
        return 0

    # ------------------------------------------------------------------ input

    cdef void _release_input(self) noexcept:
        if self._in_held:
            PyBuffer_Release(&self._in_view)
            self._in_held = False
        self._in_pos = 0

    def feed(self, data):
        """Give the parser received bytes (data_received); then call ``next_event`` until
        it returns ``EV_NEED_DATA``.  The parser keeps a reference to ``data`` until then."""
        cdef Py_ssize_t left
        self._check_alive()
        if self._gb_kind != GB_NONE:
            raise RuntimeError("feed() between get_buffer() and buffer_updated()")
        if self._in_held:
            # Not drained: keep the leftover in the internal buffer, then take the new input.
            left = self._in_view.len - self._in_pos
            self._make_room(left)
            memcpy(<unsigned char*>PyByteArray_AS_STRING(self._buf) + self._end,
                   <const unsigned char*>self._in_view.buf + self._in_pos, left)
            self._end += left
            self._release_input()
        PyObject_GetBuffer(data, &self._in_view, PyBUF_SIMPLE)
        self._in_held = True
        self._in_pos = 0
        if self._in_view.len == 0:
            self._release_input()

    cdef int _make_room(self, Py_ssize_t want) except -1:
        """At least ``want`` free bytes after ``_end``: compact, else grow into a new buffer
        (never resize: a transport may still hold a view of the old one)."""
        cdef Py_ssize_t live = self._end - self._start
        cdef Py_ssize_t cap = len(self._buf)
        cdef Py_ssize_t newcap
        cdef bytearray nb
        if cap - self._end >= want:
            return 0
        if self._start > 0 and cap - live >= want:
            if live:
                memmove(PyByteArray_AS_STRING(self._buf), PyByteArray_AS_STRING(self._buf) + self._start, live)
            self._start = 0
            self._end = live
            return 0
        newcap = cap * 2
        if newcap < live + want:
            newcap = live + want
        nb = bytearray(newcap)
        if live:
            memcpy(PyByteArray_AS_STRING(nb), PyByteArray_AS_STRING(self._buf) + self._start, live)
        self._buf = nb
        self._start = 0
        self._end = live
        return 0

    cdef const unsigned char* _contiguous(self, Py_ssize_t need) except? NULL:
        """``need`` contiguous bytes at the head of the stream, or NULL if not all arrived.
        Moves input into the internal buffer only as far as it has arrived (memory grows
        with bytes received, not with lengths claimed)."""
        cdef Py_ssize_t live = self._end - self._start
        cdef Py_ssize_t avail_in = 0
        cdef Py_ssize_t k
        if self._in_held:
            avail_in = self._in_view.len - self._in_pos
        if live >= need:
            self._src_in = False
            return <const unsigned char*>PyByteArray_AS_STRING(self._buf) + self._start
        if live == 0 and avail_in >= need:
            self._src_in = True
            return <const unsigned char*>self._in_view.buf + self._in_pos
        k = need - live
        if k > avail_in:
            k = avail_in
        if k:
            self._make_room(k)
            memcpy(<unsigned char*>PyByteArray_AS_STRING(self._buf) + self._end,
                   <const unsigned char*>self._in_view.buf + self._in_pos, k)
            self._end += k
            self._in_pos += k
            if self._in_pos == self._in_view.len:
                self._release_input()
        if self._end - self._start >= need:
            self._src_in = False
            return <const unsigned char*>PyByteArray_AS_STRING(self._buf) + self._start
        return NULL

    cdef void _consume(self, Py_ssize_t n) noexcept:
        if self._src_in:
            self._in_pos += n
            if self._in_pos == self._in_view.len:
                self._release_input()
        else:
            self._start += n
            if self._start == self._end:
                self._start = 0
                self._end = 0
        self._consumed += <uint64_t>n

    # ------------------------------------------------------------------ BufferedProtocol

    def get_buffer(self, Py_ssize_t sizehint=-1):
        """A writable view for the next received bytes: the rest of the current payload
        destination while a payload is received into one (unless that is a small segment with
        more payload after it), else the internal buffer."""
        cdef Py_ssize_t n, room
        self._check_alive()
        if self._in_held:
            raise RuntimeError("get_buffer() before the fed input was drained by next_event()")
        if self._state == ST_PAYLOAD and self._mode == M_UNSET:
            self._resolve_mode()
        if (self._state == ST_PAYLOAD and self._mode == M_DEST and self._end == self._start
                and self._remaining > 0):
            n = self._seg_len - self._seg_pos
            if <uint64_t>n > self._remaining:
                n = <Py_ssize_t>self._remaining
            # Straight into the destination, unless this is a small segment of a scatter
            # (a PUT_MANY/GET_MANY of small values): a recv per value costs a syscall and a
            # trip through the owner each, far more than the memcpy out of the buffer.
            if n >= DIRECT_MIN or <uint64_t>n == self._remaining:
                self._gb_kind = GB_DEST
                self._gb_len = n
                return self._seg_obj[self._seg_pos:self._seg_pos + n]
        if self._end == self._start and len(self._buf) > self._read_chunk and self._state != ST_TRAILER \
                and not self._have_fixed:
            self._buf = bytearray(self._read_chunk)     # drop a buffer grown for a big header
            self._start = self._end = 0
        room = len(self._buf) - self._end
        if room < MIN_READ_ROOM:
            self._make_room(self._read_chunk if self._read_chunk > MIN_READ_ROOM else MIN_READ_ROOM)
            room = len(self._buf) - self._end
        self._gb_kind = GB_INTERNAL
        self._gb_len = room
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, Py_ssize_t nbytes):
        """``nbytes`` were written into the view of the last ``get_buffer``."""
        cdef int kind = self._gb_kind
        self._check_alive()
        if kind == GB_NONE:
            raise RuntimeError("buffer_updated() without get_buffer()")
        if nbytes < 0 or nbytes > self._gb_len:
            raise InvalidArgument(f"buffer_updated({nbytes}): the buffer had {self._gb_len} bytes")
        self._gb_kind = GB_NONE
        if kind == GB_INTERNAL:
            self._end += nbytes
            return
        if self._f_flags & _FLAG_PAYLOAD_CRC:
            with nogil:
                self._pcrc = crc32c_update(self._pcrc, self._seg_ptr + self._seg_pos, <size_t>nbytes)
        self._seg_pos += nbytes
        self._remaining -= <uint64_t>nbytes
        self._consumed += <uint64_t>nbytes
        if self._seg_pos == self._seg_len and self._remaining:
            self._next_segment()

    # ------------------------------------------------------------------ payload placement

    def set_destination(self, dest):
        """Receive the current payload into ``dest``: one writable buffer, or a list/tuple
        of them filled in order (a PUT_MANY into several arena slots).  Their total size
        must be at least the payload length.  Only right after ``EV_PAYLOAD_START``."""
        cdef Py_ssize_t total = 0
        cdef uint64_t left
        self._check_alive()
        if self._state != ST_PAYLOAD or self._mode != M_UNSET:
            raise RuntimeError("set_destination() is only allowed right after EV_PAYLOAD_START")
        multi = isinstance(dest, (list, tuple))
        views = [_as_byte_view(d) for d in dest] if multi else [_as_byte_view(dest)]
        for mv in views:
            total += len(mv)
        if <uint64_t>total < self._f_plen:
            raise InvalidArgument(
                f"destination holds {total} bytes, the payload is {self._f_plen} bytes")
        segs = []
        left = self._f_plen
        for mv in views:
            if left == 0:
                break
            if <uint64_t>len(mv) > left:
                mv = mv[:left]
            if len(mv):
                segs.append(mv)
                left -= len(mv)
        self._segs = segs
        if multi:
            self._dest_result = tuple(segs)
        else:
            self._dest_result = segs[0] if segs else views[0][:0]
        self._mode = M_DEST
        self._seg_idx = -1
        self._seg_len = 0
        self._seg_pos = 0
        self._next_segment()

    def receive_bytes(self):
        """Receive the current payload into a new ``bytes`` object of its size, created
        uninitialised (``PyBytes_FromStringAndSize(NULL, n)``) and written only by this
        parser before ``EV_PAYLOAD_END`` hands it out as ``frame.payload``: one allocation,
        no zero fill, no copy after the receive (the trailer CRC is checked as with any
        destination).  Only right after ``EV_PAYLOAD_START``."""
        cdef bytes out
        cdef _BytesFill fill
        self._check_alive()
        if self._state != ST_PAYLOAD or self._mode != M_UNSET:
            raise RuntimeError("receive_bytes() is only allowed right after EV_PAYLOAD_START")
        out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>self._f_plen)   # limit-checked length
        if self._f_plen:
            fill = _BytesFill.__new__(_BytesFill)
            fill._b = out
            self._segs = [memoryview(fill)]
        else:
            self._segs = []             # b"" is the shared empty object: never written
        self._dest_result = out
        self._mode = M_DEST
        self._seg_idx = -1
        self._seg_len = 0
        self._seg_pos = 0
        self._next_segment()

    def discard_payload(self):
        """Drop the current payload (its trailer CRC is still checked)."""
        self._check_alive()
        if self._state != ST_PAYLOAD or self._mode != M_UNSET:
            raise RuntimeError("discard_payload() is only allowed right after EV_PAYLOAD_START")
        self._mode = M_DISCARD
        self._dest_result = None

    def stream_payload(self):
        """Deliver the current payload as ``EV_PAYLOAD_CHUNK`` events (``parser.chunk``)."""
        self._check_alive()
        if self._state != ST_PAYLOAD or self._mode != M_UNSET:
            raise RuntimeError("stream_payload() is only allowed right after EV_PAYLOAD_START")
        self._mode = M_STREAM
        self._dest_result = None

    cdef int _resolve_mode(self) except -1:
        # No choice made: collect into a bytearray of the (already limit-checked) length.
        collect = bytearray(<Py_ssize_t>self._f_plen)
        self._segs = [memoryview(collect)] if self._f_plen else []
        self._dest_result = collect
        self._mode = M_DEST
        self._seg_idx = -1
        self._seg_len = 0
        self._seg_pos = 0
        self._next_segment()
        return 0

    cdef int _next_segment(self) except -1:
        cdef unsigned char[::1] tv
        self._seg_idx += 1
        self._seg_pos = 0
        if self._seg_idx >= len(self._segs):
            self._seg_obj = None
            self._seg_ptr = NULL
            self._seg_len = 0
            return 0
        self._seg_obj = self._segs[self._seg_idx]
        tv = self._seg_obj
        self._seg_ptr = &tv[0]
        self._seg_len = tv.shape[0]
        return 0

    cdef Py_ssize_t _take(self, const unsigned char* src, Py_ssize_t n) except -1:
        """Consume ``n`` (<= remaining) payload bytes from ``src`` per the payload mode."""
        cdef Py_ssize_t k, done = 0
        cdef bint crc = (self._f_flags & _FLAG_PAYLOAD_CRC) != 0
        if crc:
            with nogil:
                self._pcrc = crc32c_update(self._pcrc, src, <size_t>n)
        if self._mode == M_DEST:
            while done < n:
                k = self._seg_len - self._seg_pos
                if k > n - done:
                    k = n - done
                with nogil:
                    memcpy(self._seg_ptr + self._seg_pos, src + done, k)
                self._seg_pos += k
                done += k
                if self._seg_pos == self._seg_len and done < n:
                    self._next_segment()
            if self._seg_pos == self._seg_len and <uint64_t>n < self._remaining:
                self._next_segment()
        elif self._mode == M_STREAM:
            self._chunk = PyBytes_FromStringAndSize(<const char*>src, n)
        self._remaining -= <uint64_t>n
        return n

    cdef int _finish_payload(self) except -1:
        self._frame.payload = self._dest_result
        self._segs = None
        self._seg_obj = None
        self._seg_ptr = NULL
        self._dest_result = None
        self._mode = M_UNSET
        self._state = ST_HEADER
        return _EV_END

    # ------------------------------------------------------------------ header

    cdef int _check_partial_prefix(self) except -1:
        # Reject a wrong magic or version as soon as those bytes arrive (an HTTP request
        # or a TLS hello fails at once, not after 28 bytes).  An incomplete prefix is
        # always wholly in the internal buffer (_contiguous moved it there).
        cdef const unsigned char* p = <const unsigned char*>PyByteArray_AS_STRING(self._buf) + self._start
        cdef Py_ssize_t live = self._end - self._start
        if (live >= 1 and p[0] != _MAGIC0) or (live >= 2 and p[1] != _MAGIC1):
            self._fail("bad_magic", f"magic {bytes(p[:2 if live >= 2 else 1])!r}, expected {MAGIC!r}")
        if live >= 3 and p[2] != _VERSION:
            self._fail("bad_version", f"frame version {p[2]}, this build speaks version {_VERSION}")
        return 0

    cdef int _parse_fixed(self, const unsigned char* p) except -1:
        cdef int opcode = p[3]
        cdef uint16_t flags = _get16(p + 4)
        cdef uint16_t status = _get16(p + 6)
        cdef uint64_t rid = _get64(p + 8)
        cdef uint64_t plen = _get64(p + 16)
        cdef uint64_t hlen = _get32(p + 24)
        cdef bint is_reply = (flags & _FLAG_REPLY) != 0
        if p[0] != _MAGIC0 or p[1] != _MAGIC1:
            self._fail("bad_magic", f"magic {bytes(p[:2])!r}, expected {MAGIC!r}")
        if p[2] != _VERSION:
            self._fail("bad_version", f"frame version {p[2]}, this build speaks version {_VERSION}")
        if not self._opcodes[opcode]:
            self._fail("unknown_opcode", f"opcode {opcode:#04x} is not a known "
                       f"{'reply' if self._replies else 'request'} opcode")
        if flags & ~self._allowed_flags:
            self._fail("bad_flags", f"unknown flag bits {flags & ~self._allowed_flags:#06x}")
        if is_reply != self._replies:
            self._fail("bad_flags", "a reply where a request was expected" if is_reply
                       else "a request where a reply was expected")
        if (opcode == _OP_ERROR) != (status != 0):
            self._fail("bad_status", f"status {status} with opcode {opcode:#04x} "
                       "(non-zero exactly in ERROR replies)")
        if rid == 0 and opcode != _OP_ERROR:
            self._fail("bad_request_id", "request id 0 is reserved for connection-level errors")
        if hlen > self._max_header:
            self._fail("header_too_long", f"header of {hlen} bytes, limit {self._max_header}")
        if plen > self._max_payload:
            self._fail("payload_too_large", f"payload of {plen} bytes, limit {self._max_payload}")
        self._f_opcode = opcode
        self._f_flags = flags
        self._f_status = status
        self._f_request_id = rid
        self._f_hlen = hlen
        self._f_plen = plen
        self._have_fixed = True
        return 0

    cdef int _start_frame(self, const unsigned char* p) except -1:
        cdef Py_ssize_t hlen = <Py_ssize_t>self._f_hlen
        cdef uint32_t want = _get32(p + _FIXED + hlen)
        cdef uint32_t got
        with nogil:
            got = crc32c_update(0, p, <size_t>(_FIXED + hlen))
        if got != want:
            self._fail("bad_header_crc", f"header CRC32C {want:#010x}, computed {got:#010x}")
        cdef Frame f = Frame.__new__(Frame)
        f.opcode = self._f_opcode
        f.flags = self._f_flags
        f.status = self._f_status
        f.request_id = self._f_request_id
        f.header = PyBytes_FromStringAndSize(<const char*>p + _FIXED, hlen)
        f.payload_length = self._f_plen
        f.payload = None
        f.offset = self._consumed
        self._frame = f
        return 0

    # ------------------------------------------------------------------ events

    cpdef int next_event(self) except -1:
        """Advance; returns one of the ``EV_*`` codes (``parser.frame`` / ``parser.chunk``)."""
        cdef const unsigned char* p
        cdef Py_ssize_t need, n, avail
        cdef uint32_t want
        self._check_alive()
        if self._gb_kind != GB_NONE:
            raise RuntimeError("next_event() between get_buffer() and buffer_updated()")
        while True:
            if self._state == ST_HEADER:
                if not self._have_fixed:
                    p = self._contiguous(_FIXED)
                    if p == NULL:
                        self._check_partial_prefix()
                        return _EV_NEED
                    self._parse_fixed(p)
                need = _FIXED + <Py_ssize_t>self._f_hlen + _CRC
                p = self._contiguous(need)
                if p == NULL:
                    return _EV_NEED
                self._start_frame(p)
                self._consume(need)
                self._have_fixed = False
                if self._f_plen == 0 and not (self._f_flags & _FLAG_PAYLOAD_CRC):
                    return _EV_FRAME
                self._state = ST_PAYLOAD
                self._mode = M_UNSET
                self._remaining = self._f_plen
                self._pcrc = 0
                return _EV_START

            if self._state == ST_PAYLOAD:
                if self._mode == M_UNSET:
                    self._resolve_mode()
                if self._remaining == 0:
                    if self._f_flags & _FLAG_PAYLOAD_CRC:
                        self._state = ST_TRAILER
                        continue
                    return self._finish_payload()
                avail = self._end - self._start
                if avail:
                    n = avail if <uint64_t>avail <= self._remaining else <Py_ssize_t>self._remaining
                    self._take(<const unsigned char*>PyByteArray_AS_STRING(self._buf) + self._start, n)
                    self._src_in = False
                    self._consume(n)
                elif self._in_held:
                    avail = self._in_view.len - self._in_pos
                    n = avail if <uint64_t>avail <= self._remaining else <Py_ssize_t>self._remaining
                    self._take(<const unsigned char*>self._in_view.buf + self._in_pos, n)
                    self._src_in = True
                    self._consume(n)
                else:
                    return _EV_NEED
                if self._mode == M_STREAM:
                    return _EV_CHUNK
                continue

            if self._state == ST_TRAILER:
                p = self._contiguous(_CRC)
                if p == NULL:
                    return _EV_NEED
                want = _get32(p)
                if want != self._pcrc:
                    self._fail("bad_payload_crc",
                               f"payload CRC32C {want:#010x}, computed {self._pcrc:#010x}")
                self._consume(_CRC)
                return self._finish_payload()

            raise self._error
