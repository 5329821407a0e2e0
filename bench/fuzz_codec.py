"""Coverage-guided fuzzing of the wire protocol with atheris (libFuzzer for Python).

    .venv/bin/pip install atheris
    .venv/bin/python bench/fuzz_codec.py -runs=1000000

Each input is split into a stream of bytes and a recipe (how the stream is cut into
reads, and what the consumer does at each payload start).  The stream goes through the
Cython FrameParser as the server feeds it (``feed`` or ``get_buffer``/``buffer_updated``),
and every complete frame's header body through the message decoder of its opcode.  The
only exceptions allowed are the protocol's own refusals (MalformedFrame for the frame,
InvalidArgument for a body); anything else, or a crash, is a finding.  The pure-Python
decoders are instrumented for coverage; the Cython parser is exercised as a black box.
"""
import sys


def main(argv=None) -> int:
    import atheris

    with atheris.instrument_imports():
        from quillcache.errors import InvalidArgument
        from quillcache.protocol import messages
        from quillcache.protocol.opcodes import KNOWN_FLAGS, REQUEST_OPCODES, Opcode

    from quillcache._native.codec import (
        EV_FRAME, EV_NEED_DATA, EV_PAYLOAD_START, FrameParser, MalformedFrame, encode_frame_header,
    )

    ops = sorted(int(o) for o in REQUEST_OPCODES)
    decoders = {
        Opcode.HELLO: messages.decode_hello_request,
        Opcode.GET: messages.decode_get_request,
        Opcode.PUT: messages.decode_put_request,
        Opcode.PUT_MANY: messages.decode_put_many_request,
        Opcode.GET_MANY: messages.decode_keys_request,
        Opcode.EXISTS: messages.decode_keys_request,
        Opcode.REMOVE: messages.decode_keys_request,
        Opcode.PIN: messages.decode_pin_request,
        Opcode.UNPIN: messages.decode_unpin_request,
        Opcode.LIST: messages.decode_list_request,
        Opcode.STATS: messages.decode_stats_request,
    }

    def one_input(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        recipe = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        # Mostly well-formed frames (valid CRC) with fuzzed bodies, so the decoders are
        # reached; then a few flipped bytes so the parser's refusals are reached too.
        out = bytearray()
        for _ in range(fdp.ConsumeIntInRange(0, 4)):
            op = ops[fdp.ConsumeIntInRange(0, len(ops) - 1)]
            header = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300))
            payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
            flags = fdp.ConsumeIntInRange(0, KNOWN_FLAGS) & ~1          # requests carry no REPLY
            rid = fdp.ConsumeIntInRange(1, 1 << 40)
            try:
                out += encode_frame_header(op, rid, flags=flags, header=header, payload_length=len(payload))
            except (ValueError, InvalidArgument):
                continue
            out += payload
            if flags & 2:                                                # PAYLOAD_CRC trailer
                out += fdp.ConsumeBytes(4)
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            if out:
                out[fdp.ConsumeIntInRange(0, len(out) - 1)] ^= fdp.ConsumeIntInRange(1, 255)
        stream = bytes(out) + fdp.ConsumeBytes(fdp.remaining_bytes())
        parser = FrameParser(ops, max_header_bytes=4096, max_payload_bytes=1 << 16,
                             allowed_flags=KNOWN_FLAGS)
        pos, step = 0, 0
        try:
            while pos < len(stream):
                r = recipe[step % len(recipe)] if recipe else 255
                step += 1
                n = min(len(stream) - pos, 1 + r % 97)
                if r & 1:
                    parser.feed(stream[pos:pos + n])
                else:
                    view = parser.get_buffer(-1)
                    n = min(n, len(view))
                    view[:n] = stream[pos:pos + n]
                    parser.buffer_updated(n)
                pos += n
                while (ev := parser.next_event()) != EV_NEED_DATA:
                    if ev == EV_PAYLOAD_START:
                        choice = r % 3
                        if choice == 0:
                            parser.set_destination(bytearray(parser.frame.payload_length))
                        elif choice == 1:
                            parser.discard_payload()
                    elif ev == EV_FRAME:
                        frame = parser.frame
                        decode = decoders.get(frame.opcode)
                        if decode is not None:
                            try:
                                decode(frame.header)
                            except InvalidArgument:
                                pass
        except MalformedFrame:
            assert parser.failed

    atheris.Setup([sys.argv[0], *(sys.argv[1:] if argv is None else argv)], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
