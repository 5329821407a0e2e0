"""The QuillCache wire protocol: constants, message bodies and the sans-I/O connections.

    opcodes     Opcode, Flag, Status, PinMode, InfoFormat, ProtocolLimits, frame constants
    messages    encode_*/decode_* of every request and reply header body
    connection  ProtocolConnection (server side), ClientProtocolConnection, Reply

The frame codec itself is the Cython module ``quillcache._native.codec``
(FrameParser, encode_frame_header, crc32c).  docs/protocol.md is the spec.
"""
from quillcache._native.codec import (
    EV_FRAME, EV_NEED_DATA, EV_PAYLOAD_CHUNK, EV_PAYLOAD_END, EV_PAYLOAD_START, Frame,
    FrameParser, MalformedFrame, crc32c, encode_frame_header,
)
from quillcache.protocol.connection import ClientProtocolConnection, ProtocolConnection, Reply
from quillcache.protocol.opcodes import (
    FLAG_DURABLE, FLAG_PAYLOAD_CRC, FLAG_REPLY, PROTOCOL_VERSION, Flag, InfoFormat, Opcode,
    PinMode, ProtocolLimits, Status, Violation,
)

__all__ = [
    "Opcode", "Flag", "Status", "PinMode", "InfoFormat", "Violation", "ProtocolLimits",
    "PROTOCOL_VERSION", "FLAG_REPLY", "FLAG_PAYLOAD_CRC", "FLAG_DURABLE",
    "Frame", "FrameParser", "MalformedFrame", "encode_frame_header", "crc32c",
    "EV_NEED_DATA", "EV_FRAME", "EV_PAYLOAD_START", "EV_PAYLOAD_CHUNK", "EV_PAYLOAD_END",
    "ProtocolConnection", "ClientProtocolConnection", "Reply",
]
