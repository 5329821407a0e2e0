"""Run the gateway in the foreground on uvloop (the process never forks; systemd runs it).

SIGTERM / SIGINT stop accepting, let the answers in flight finish for up to
``DRAIN_TIMEOUT_S`` and exit 0.  A configuration that cannot start (a tokenizer file that
does not load, the address in use) exits 78, like ``quillcached``.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Optional

from aiohttp import web

from quillcache.node.settings import EX_CONFIG
from quillcache.net import format_hostport
from quillcache.errors import InvalidArgument

__all__ = ["run", "start", "DRAIN_TIMEOUT_S"]

log = logging.getLogger("quillcache.gateway")

DRAIN_TIMEOUT_S = 10.0           # seconds answers in flight get at SIGTERM


async def start(cfg, host: Optional[str] = None, port: Optional[int] = None):
    """Start the gateway on the running loop; returns (gateway, runner, (host, port))."""
    from quillcache.gateway.app import Gateway
    gw = Gateway(cfg)
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=DRAIN_TIMEOUT_S)
    await runner.setup()
    h, p = cfg.gateway.listen
    site = web.TCPSite(runner, host or h, p if port is None else port, backlog=1024, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][:2]
    return gw, runner, bound


def run(cfg) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    import uvloop

    from quillcache.service import sd_notify, setup_logging
    setup_logging("info")

    async def main() -> int:
        try:
            gw, runner, bound = await start(cfg)
        except InvalidArgument as exc:
            log.error("quillcache-gateway: %s", exc)
            return EX_CONFIG
        except OSError as exc:
            log.error("quillcache-gateway: cannot listen on %s: %s", format_hostport(cfg.gateway.listen),
                      exc.strerror or exc)
            return EX_CONFIG
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("quillcache-gateway listening on %s with %d engines", format_hostport(bound),
                 len(gw.engines))
        sd_notify("READY=1")
        await stop.wait()
        sd_notify("STOPPING=1")
        await runner.cleanup()
        return 0

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
