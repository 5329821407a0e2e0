"""gateway/listener.py: the connection gate's refusals, on a real aiohttp runner on loopback."""
from __future__ import annotations

import asyncio
import socket
import time

from aiohttp import web

from quillcache.gateway.listener import MAX_LINGERING, REFUSED_LINGER_S, ConnectionGate, Listener, _Refused


def _reset_after_sending(s: socket.socket) -> bool:
    """Whether the peer resets ``s`` when it sends more (a fully closed socket answers data
    with a reset; a lingering half-closed one discards it)."""
    try:
        for _ in range(3):
            s.sendall(b"x" * 1000)
            time.sleep(0.03)
        s.settimeout(0.2)
        while s.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        pass
    return False


def test_past_max_lingering_the_oldest_refused_connection_is_closed_not_the_newest():
    """A flood of silent connections past the limit: at most MAX_LINGERING refused ones
    linger; the one that lingered longest is closed to make room, so the newest refused
    client (a real one arriving behind the flood) can still send its request and read its
    503 rather than a reset."""
    async def main():
        app = web.Application()
        runner = web.AppRunner(app)
        await runner.setup()
        listener = Listener(runner, ConnectionGate(1))
        _, port = await listener.start("127.0.0.1", 0)
        socks = []
        try:
            for _ in range(MAX_LINGERING + 10):          # the first takes the slot, the rest are refused
                s = socket.create_connection(("127.0.0.1", port))
                socks.append(s)
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            newest_reset = await asyncio.to_thread(_reset_after_sending, socks[-1])
            oldest_reset = await asyncio.to_thread(_reset_after_sending, socks[1])
            assert time.monotonic() - t0 < REFUSED_LINGER_S      # still within the newest's linger
            assert not newest_reset and oldest_reset
        finally:
            for s in socks:
                s.close()
            listener.close()
            await runner.cleanup()
            await asyncio.sleep(REFUSED_LINGER_S + 0.1)
        assert not _Refused.lingering                            # every refused one ended
    asyncio.run(main())
