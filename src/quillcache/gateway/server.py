"""Run the gateway in the foreground on uvloop (the process never forks; systemd runs it).

Two addresses: the tenants' API on ``[gateway] listen`` (at most ``[gateway] max_connections``
open at once) and the operator's endpoints on ``[gateway] admin_listen`` (``ADMIN_CONNECTIONS``
of its own), both under aiohttp's header timeout (``client_header_timeout``).  SIGTERM / SIGINT stop accepting,
let the answers in flight finish for up to ``DRAIN_TIMEOUT_S`` and exit 0.  SIGHUP reloads
the configuration file: the reloadable settings take effect for the next request, a changed
fixed one is logged and kept as it runs.  A configuration that cannot start (a tokenizer
file that does not load, an address in use) exits 78, like ``quillcached``.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable, Optional

from aiohttp import web

from quillcache.errors import InvalidArgument
from quillcache.gateway.listener import ConnectionGate, Listener, raise_fd_limit
from quillcache.net import format_hostport
from quillcache.errors import ConfigError
from quillcache.exitcodes import CONFIG as EX_CONFIG

__all__ = ["run", "start", "GatewayService", "DRAIN_TIMEOUT_S"]

log = logging.getLogger("quillcache.gateway")

DRAIN_TIMEOUT_S = 10.0           # seconds answers in flight get at SIGTERM
ADMIN_CONNECTIONS = 64           # connections the admin address takes at once (its own, apart)
LINGER_S = 1.0                   # seconds an unread body is still read after an early answer (408,
                                 # 413) so that the client sees it before the close (aiohttp: 10 s)


class GatewayService:
    """A started gateway: its two runners and listeners; ``cleanup`` stops all of it."""

    def __init__(self, gw, runners: list[web.AppRunner], listeners: list[Listener]) -> None:
        self.gw = gw
        self.runners = runners
        self.listeners = listeners
        self.address: tuple[str, int] = ("", 0)
        self.admin_address: tuple[str, int] = ("", 0)

    async def cleanup(self) -> None:
        for listener in self.listeners:            # stop accepting first, then drain
            listener.close()
        for runner in self.runners:
            await runner.cleanup()


async def start(cfg, host: Optional[str] = None, port: Optional[int] = None):
    """Start the gateway on the running loop; returns (gateway, service, (host, port)), where
    ``service.admin_address`` is the operator's address."""
    from quillcache.gateway.app import Gateway
    g = cfg.gateway
    gw = Gateway(cfg)
    limit = raise_fd_limit(g.max_connections + ADMIN_CONNECTIONS) - ADMIN_CONNECTIONS
    limit = max(limit, 1)
    if limit < g.max_connections:
        log.warning("[gateway] max_connections = %d does not fit the descriptor limit: %d connections "
                    "at most", g.max_connections, limit)
    refused = gw.metrics.connections_refused
    gate = ConnectionGate(limit, g.max_connections_per_peer, on_refused=lambda reason: refused.labels(reason).inc())
    # aiohttp's own limits: keepalive_timeout closes a connection with no complete request head
    # (silent, slow headers, idle keep-alive); the header sizes keep aiohttp's defaults.
    kw = dict(handler_cancellation=True, access_log=None, shutdown_timeout=DRAIN_TIMEOUT_S,
              keepalive_timeout=g.client_header_timeout, lingering_time=LINGER_S)
    runner, admin_runner = web.AppRunner(gw.app, **kw), web.AppRunner(gw.admin_app, **kw)
    # The admin address has its own few slots: a flood of the tenants' address leaves the
    # operator able to see it (/metrics).
    admin_gate = ConnectionGate(ADMIN_CONNECTIONS, on_refused=lambda reason: refused.labels("admin").inc())
    service = GatewayService(gw, [runner, admin_runner],
                             [Listener(runner, gate), Listener(admin_runner, admin_gate)])
    try:
        await runner.setup()
        await admin_runner.setup()
        h, p = g.listen
        service.address = await service.listeners[0].start(host or h, p if port is None else port)
        service.admin_address = await service.listeners[1].start(*g.admin_listen)
    except BaseException:
        await service.cleanup()
        raise
    return gw, service, service.address


def run(cfg, reload: Optional[Callable[[], object]] = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code.  ``reload`` loads the configuration
    again (SIGHUP); without it SIGHUP is logged and ignored."""
    import uvloop

    from quillcache.service import sd_notify, setup_logging
    setup_logging("info")

    def on_hup(gw) -> None:
        if reload is None:
            log.warning("SIGHUP: no configuration file to reload from; ignored")
            return
        try:
            new = reload()
            applied, kept = gw.reload(new)
        except ConfigError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
            return
        for qualname in kept:
            log.warning("reload: %s changed: it needs a restart, the running value is kept", qualname)
        log.info("reloaded %s: %s", getattr(new, "source", "the configuration"),
                 ", ".join(applied) if applied else "no reloadable setting changed")

    async def main() -> int:
        # Handlers before start: its ports listen before it returns, and a HUP or TERM that
        # lands then (from whoever found them open) must not take the default action (exit).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # One HUP handler throughout: a HUP's callback can run after start returned, so it
        # reads whether the gateway is up at the time it runs, not when it was caught.
        up: list = []
        held: list[bool] = []

        def hup() -> None:
            if up:
                on_hup(up[0])
            else:
                held.append(True)

        loop.add_signal_handler(signal.SIGHUP, hup)
        try:
            gw, service, bound = await start(cfg)
        except InvalidArgument as exc:
            log.error("quillcache-gateway: %s", exc)
            return EX_CONFIG
        except OSError as exc:
            log.error("quillcache-gateway: cannot listen on %s or %s: %s", format_hostport(cfg.gateway.listen),
                      format_hostport(cfg.gateway.admin_listen), exc.strerror or exc)
            return EX_CONFIG
        up.append(gw)
        if held:                         # a HUP during start: apply it now
            on_hup(gw)
        log.info("quillcache-gateway listening on %s (admin %s) with %d engines", format_hostport(bound),
                 format_hostport(service.admin_address), len(gw.engines))
        sd_notify("READY=1")
        await stop.wait()
        sd_notify("STOPPING=1")
        await service.cleanup()
        return 0

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
