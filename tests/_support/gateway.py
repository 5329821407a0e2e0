"""Start simulated engines and a gateway on free loopback ports, in this process's loop."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiohttp

from quillcache.settings.convert import hash_token
from tests._support.ports import free_port

__all__ = ["free_port", "Harness", "TOKENS", "read_sse", "harness", "gateway", "wait_until"]

TOKENS = {"acme": "key-acme-0123456789", "globex": "key-globex-0123456789"}


@dataclass
class Harness:
    """``n`` simulated engines (with KV events) behind one gateway."""

    n: int = 2
    tokenizer: str = ""
    gateway_toml: str = ""
    engine_extra: str = ""
    dead_engines: int = 0              # engines listed in the config that nothing listens for
    auth: bool = True
    time_scale: float = 1.0
    capacity_blocks: int = 4096
    roles: tuple = ()                  # the role of each engine (default: "both")
    extra_engines: tuple = ()          # more [[gateway.engines]] tables, as TOML text
    sims: list = field(default_factory=list)
    urls: list = field(default_factory=list)

    async def __aenter__(self) -> "Harness":
        from quillcache.control.sim.server import SimServerConfig, start_server
        from quillcache.gateway.server import start
        from quillcache.gateway.settings import load_gateway_config
        from quillcache.control.sim.engine import EngineConfig
        engines = []
        for i in range(self.dead_engines):
            engines.append(f'[[gateway.engines]]\nid = "dead{i}"\nurl = "http://127.0.0.1:{free_port()}"\n'
                           f'model = "m"\nadapters = ["lora-x"]\n{self.engine_extra}')
        for i in range(self.n):
            ev, rp = free_port(), free_port()
            cfg = SimServerConfig(model="m", adapters=("lora-x",), time_scale=self.time_scale,
                                  engine=EngineConfig(capacity_blocks=self.capacity_blocks))
            runner, listening, close_pub = await start_server(
                cfg, "127.0.0.1", 0, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
            self.sims.append((runner, close_pub))
            self.urls.append(listening.http)
            tok = f'tokenizer = "{self.tokenizer}"\n' if self.tokenizer else ""
            role = f'role = "{self.roles[i]}"\n' if self.roles else ""
            engines.append(f'[[gateway.engines]]\nid = "e{i}"\nurl = "{listening.http}"\nmodel = "m"\n'
                           f'adapters = ["lora-x"]\nkv_events = "{listening.events}"\n'
                           f'kv_replay = "{listening.replay}"\n{tok}{role}{self.engine_extra}')
        engines.extend(self.extra_engines)
        auth = ""
        if self.auth:
            auth = "".join(f'[[auth.tenants]]\nname = "{n}"\ntoken = "{hash_token(t)}"\n'
                           for n, t in TOKENS.items())
        text = (f'[gateway]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n{self.gateway_toml}\n'
                + auth + "".join(engines))
        self.cfg = load_gateway_config(text=text)
        self.gw, self.runner, bound = await start(self.cfg)
        self.base = f"http://{bound[0]}:{bound[1]}"
        self.admin = "http://{}:{}".format(*self.runner.admin_address)      # the operator's endpoints
        self.session = aiohttp.ClientSession()
        await asyncio.sleep(0.3)          # ZMQ slow joiner: let the SUB sockets connect
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.runner.cleanup()
        for runner, close_pub in self.sims:
            await runner.cleanup()
            close_pub()

    def headers(self, tenant: str = "acme") -> dict:
        return {"Authorization": f"Bearer {TOKENS[tenant]}"} if self.auth else {}

    async def complete(self, prompt, tenant: str = "acme", stream: bool = True, max_tokens: int = 4,
                       model: str = "m", path: str = "/v1/completions", **extra):
        body = {"model": model, "max_tokens": max_tokens, "stream": stream, **extra}
        if path.endswith("chat/completions"):
            body["messages"] = prompt
        else:
            body["prompt"] = prompt
        async with self.session.post(self.base + path, json=body, headers=self.headers(tenant)) as r:
            data = await r.read()
            return r.status, dict(r.headers), data

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Until no request is in flight in the gateway and every router load is back to zero."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            busy = [e.id for e in self.gw.engines.values() if e.in_flight]
            loads = [self.gw.router.load_of(e).get("active_requests", 0) for e in self.gw.engines]
            if not busy and not any(loads):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"still busy: in flight {busy}, router loads {loads}")
            await asyncio.sleep(0.02)


async def read_sse(resp) -> list[bytes]:
    """The data payloads of an SSE response, in order."""
    out = []
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    out.append(line[6:])
    return out


@contextlib.asynccontextmanager
async def harness(**kw):
    h = Harness(**kw)
    await h.__aenter__()
    try:
        yield h
    finally:
        await h.__aexit__(None, None, None)


@contextlib.asynccontextmanager
async def gateway(text: str):
    """A gateway from TOML text (``[gateway] listen`` and ``admin_listen`` are set to free
    ports), in this loop; yields (Gateway, base URL, admin URL, an aiohttp session)."""
    from quillcache.gateway.server import start
    from quillcache.gateway.settings import load_gateway_config
    cfg = load_gateway_config(text=text).with_overrides({"gateway.listen": "127.0.0.1:0",
                                                         "gateway.admin_listen": "127.0.0.1:0"})
    gw, runner, bound = await start(cfg)
    session = aiohttp.ClientSession()
    try:
        yield gw, f"http://{bound[0]}:{bound[1]}", "http://{}:{}".format(*runner.admin_address), session
    finally:
        await session.close()
        await runner.cleanup()


async def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate()`` every 20 ms; returns the seconds it took, raises after ``timeout``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not predicate():
        if loop.time() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return loop.time() - t0
