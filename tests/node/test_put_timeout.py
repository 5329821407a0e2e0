"""A put whose payload comes later than put_timeout: its slot was reaped (and may be
another put's by then), so not one more of its bytes lands in the arena, the late client
gets a clear error and its connection closes, and the block stored since is intact."""
import time

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.errors import Timeout
from quillcache.model import encode_key
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from tests._support.daemon import Daemon
from tests._support.data import content, key
from tests._support.net import raw_connect, read_frames


def test_a_late_put_writes_nothing_into_a_reaped_slot(tmp_path):
    n = 256 << 10                       # the arena holds 4 blocks: the reaped slot is reused
    with Daemon(tmp_path, dram="1MiB", max_block="512KiB", sections={"store": 'put_timeout = "1s"'}) as d:
        late = raw_connect(d.port)
        late.sendall(encode_frame_header(Opcode.PUT, 1, header=messages.encode_put_request(encode_key(key(1)), n),
                                         payload_length=n) + b"a" * (n // 2))
        deadline = time.monotonic() + 15
        with Client(d.addr) as c:
            while c.info("Store")["Store"]["puts_reaped"] == 0:      # the reaper's turn
                assert time.monotonic() < deadline
                time.sleep(0.1)
            c.put_many([(key(10 + i), content(10 + i, n)) for i in range(4)])   # every slot, the reaped one too
        late.sendall(b"b" * (n // 2))
        (reply,) = read_frames(late, 1, timeout=10)
        assert reply.request_id == 0 and reply.status == Timeout.status     # the connection's error
        try:
            assert late.recv(1) == b""                                       # and it is closed
        except ConnectionResetError:
            pass                                # closed with the late bytes unread: a reset
        late.close()
        with Client(d.addr) as c:
            assert c.get_many([key(10 + i) for i in range(4)]) == [content(10 + i, n) for i in range(4)]
            assert c.exists(key(1)) is False
