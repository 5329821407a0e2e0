# The contract of the frame codec (see docs/protocol.md for the wire format).
#
# Other extensions reach the codec only through this file.  ``crc32c_update`` is the
# CRC32C (Castagnoli) used by the frame header and the optional payload trailer; it lives
# in quillcache._native.crc and stays reachable here for extensions that cimport it from
# the codec.
from cpython.buffer cimport Py_buffer
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from quillcache._native.crc cimport crc32c_update


cdef class Frame:
    cdef readonly int opcode
    cdef readonly int flags
    cdef readonly int status
    cdef readonly uint64_t request_id
    cdef readonly bytes header            # the variable header body (CRC-checked)
    cdef readonly uint64_t payload_length # payload bytes, the optional CRC trailer excluded
    cdef readonly object payload          # None | bytearray | memoryview | tuple of memoryviews
    cdef readonly uint64_t offset         # stream offset of the frame's first byte


cdef class FrameParser:
    cdef:
        # configuration (fixed at construction)
        uint64_t _max_header            # bytes of variable header
        uint64_t _max_payload           # bytes of payload
        bint _replies                   # True: parse replies (client side); False: requests
        uint16_t _allowed_flags
        unsigned char _opcodes[256]     # 1 = opcode accepted
        Py_ssize_t _read_chunk          # bytes offered by get_buffer outside payloads

        # internal buffer: live bytes are [_start, _end); replaced, never resized
        bytearray _buf
        Py_ssize_t _start
        Py_ssize_t _end

        # input given to feed() and not yet consumed
        Py_buffer _in_view
        bint _in_held
        Py_ssize_t _in_pos
        bint _src_in                    # the last _contiguous() result points into the input

        # frame state
        int _state
        bint _have_fixed
        int _f_opcode
        int _f_flags
        int _f_status
        uint64_t _f_request_id
        uint64_t _f_hlen
        uint64_t _f_plen
        uint64_t _consumed              # stream bytes consumed so far
        Frame _frame

        # payload state
        int _mode
        uint64_t _remaining
        list _segs                      # destination segments (1-D unsigned byte memoryviews)
        Py_ssize_t _seg_idx
        unsigned char* _seg_ptr
        Py_ssize_t _seg_len
        Py_ssize_t _seg_pos
        object _seg_obj                 # keeps the current segment's buffer alive
        object _dest_result             # what Frame.payload becomes at the end
        uint32_t _pcrc                  # running payload CRC32C (when the frame has a trailer)
        bytes _chunk

        # get_buffer() bookkeeping
        int _gb_kind
        Py_ssize_t _gb_len

        object _error

    cdef int _fail(self, str reason, str message) except -1
    cdef const unsigned char* _contiguous(self, Py_ssize_t need) except? NULL
    cdef void _consume(self, Py_ssize_t n) noexcept
    cdef int _make_room(self, Py_ssize_t want) except -1
    cdef int _parse_fixed(self, const unsigned char* p) except -1
    cdef int _check_partial_prefix(self) except -1
    cdef int _start_frame(self, const unsigned char* p) except -1
    cdef int _resolve_mode(self) except -1
    cdef int _next_segment(self) except -1
    cdef Py_ssize_t _take(self, const unsigned char* src, Py_ssize_t n) except -1
    cdef int _finish_payload(self) except -1
    cdef void _release_input(self) noexcept
    cpdef int next_event(self) except -1
    cdef int _check_alive(self) except -1
