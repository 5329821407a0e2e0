"""``AsyncClient``: the asyncio client, an ``asyncio.BufferedProtocol`` over the same flows."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from quillcache.net import DEFAULT_ADDRESS, tune_same_host
from quillcache.errors import (
    ConnectionLost, QuillCacheError, Timeout,
)
from quillcache.model import (
    KvBlockKey, decode_key,
)
from quillcache.protocol.connection import ClientProtocolConnection, Reply


from quillcache.client import shm
from quillcache.client.calls import (
    DEFAULT_TIMEOUT_S, CLIENT_NAME, MAX_REPLY_PAYLOAD, UNIX_PREFIX, Post, Req, resolve_address, token_bytes,
)
from quillcache.client.ops import _STALE, Ops
from quillcache.client.sync import Client

__all__ = ["AsyncClient"]


def _expire(fut: asyncio.Future, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(Timeout(f"no reply within {timeout} s"))


def _drop_reply(fut: asyncio.Future) -> None:
    """A posted request's reply (``calls.Post``): nobody waits for it; a connection lost
    before it came is retrieved here so that asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


class _AsyncConnection(ClientProtocolConnection, asyncio.BufferedProtocol):
    def __init__(self) -> None:
        super().__init__()
        self.transport: Optional[asyncio.Transport] = None
        self.futures: dict[int, asyncio.Future] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            tune_same_host(sock)        # its PUTs are not paced on loopback (quillcache.net)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._fail_all(self.failed or ConnectionLost("connection closed"))

    def eof_received(self):
        super().eof_received()
        return False

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        if self.close_requested and self.transport is not None:
            self.transport.close()

    def _write(self, data: list) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionLost("connection is closed")
        if len(data) == 1:
            t.write(data[0])            # a request without payload: no list join
        else:
            t.writelines(data)

    def _on_reply(self, reply: Reply) -> None:
        fut = self.futures.pop(reply.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _on_error(self, exc: BaseException) -> None:
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.close()

    def _fail_all(self, exc: BaseException) -> None:
        if not isinstance(exc, QuillCacheError):
            exc = ConnectionLost(str(exc))
        futures, self.futures = self.futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(exc)


class AsyncClient(Ops):
    """The asyncio client: ``async with AsyncClient(addr, token=...) as c: await c.get(key)``
    (or ``await AsyncClient(...).connect()``).  Same methods as Client, as coroutines."""

    def __init__(self, address=DEFAULT_ADDRESS, token=None, timeout: float = DEFAULT_TIMEOUT_S, *,
                 client_name: str = CLIENT_NAME, shm: bool = True) -> None:
        self.address = resolve_address(address)
        self.timeout = float(timeout)
        self._token = token_bytes(token)
        self._name = client_name
        self._conn: Optional[_AsyncConnection] = None
        self.tenant: Optional[str] = None
        self.server_name = ""
        self._want_shm = bool(shm)
        self.shm_refused = ""

    async def _connect_unix(self, loop) -> "AsyncClient":
        # HELLO and MAP need recvmsg (the fd rides SCM_RIGHTS), which asyncio transports do
        # not offer: they run on a blocking socket in a worker thread (the sync Client),
        # then the socket, idle and with nothing buffered, is handed to the loop.
        sync = await asyncio.to_thread(Client, UNIX_PREFIX + self.address, self._token, self.timeout,
                                       client_name=self._name, shm=self._want_shm)
        self.tenant, self.server_name, self.shm_refused = sync.tenant, sync.server_name, sync.shm_refused
        sock, limits, self._arena = sync.detach()
        try:
            _, conn = await loop.create_unix_connection(_AsyncConnection, sock=sock)
        except BaseException:
            sock.close()
            await self.close()
            raise
        conn.peer_limits = limits
        conn.accept_peer_payloads(MAX_REPLY_PAYLOAD)
        self._conn = conn
        return self

    async def connect(self) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        if isinstance(self.address, str):
            return await self._connect_unix(loop)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_AsyncConnection, *self.address), self.timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"connecting to {self.address[0]}:{self.address[1]} timed out") from None
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.address[0]}:{self.address[1]}: "
                                 f"{exc.strerror or exc}") from None
        self._conn = conn
        try:
            hello = await self._exec(self._hello_req(self._token, self._name))
            conn.accept_peer_payloads(MAX_REPLY_PAYLOAD)
        except BaseException:
            await self.close()
            raise
        self.tenant = hello.tenant_id or None
        self.server_name = hello.server_name
        return self

    async def close(self) -> None:
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()

    async def reconnect(self) -> "AsyncClient":
        """Close and connect again (HELLO, and MAP on the Unix socket)."""
        await self.close()
        self._conn = None
        self.shm_refused = ""
        return await self.connect()

    async def _drive(self, flow):
        """Run a client/shm.py flow, awaiting each request (``Req``) or ``Batch`` it yields;
        a ``Post`` is sent and its result is None."""
        try:
            req = next(flow)
            while True:
                try:
                    kind = type(req)
                    if kind is Post:
                        result = None if self._post(req.req) else await self._exec(req.req)
                    else:
                        result = await (self._exec(req) if kind is Req else self._exec_many(*req))
                except BaseException as exc:
                    req = flow.throw(exc)
                else:
                    req = flow.send(result)
        except StopIteration as stop:
            return stop.value
        except ConnectionLost as exc:
            raise ConnectionLost(f"{exc}{_STALE}") from None

    @contextlib.asynccontextmanager
    async def get_many_located(self, keys: Iterable[KvBlockKey]):
        """``Client.get_many_located``, as an async context manager (the same ``shm.LocatedRead``)."""
        op = shm.LocatedRead(self, keys)
        views = await self._drive(op.enter())
        ok = False
        try:
            yield views
            ok = True
        finally:
            await self._drive(op.exit(ok))

    @contextlib.asynccontextmanager
    async def put_many_reserved(self, items: Iterable[tuple[KvBlockKey, int]], durable: bool = False):
        """``Client.put_many_reserved``, as an async context manager (the same ``shm.ReservedWrite``)."""
        op = shm.ReservedWrite(self, items, durable)
        views = await self._drive(op.enter())
        try:
            yield views
        except BaseException:
            await self._drive(op.abort())
            raise
        await self._drive(op.commit())

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _send(self, req: Req) -> asyncio.Future:
        conn = self._conn
        if conn is None:
            raise ConnectionLost("not connected (use `async with` or await connect())")
        if conn.failed is not None or conn.closed:
            err = conn.failed
            raise err if isinstance(err, QuillCacheError) else ConnectionLost(f"connection is closed ({err})")
        fut = asyncio.get_running_loop().create_future()
        rid = conn.send_request(req.opcode, req.header, req.views, flags=req.flags, into=req.into)
        conn.futures[rid] = fut
        return fut

    async def _wait(self, fut: asyncio.Future, deadline: float) -> Reply:
        """The reply in ``fut`` by ``deadline``: one timer on the future itself (no
        wait_for/shield task per request).  On Timeout the request stays pending on the
        connection: its late reply is matched and dropped."""
        if not fut.done():
            left = deadline - time.monotonic()
            timer = asyncio.get_running_loop().call_later(max(left, 0.0), _expire, fut, self.timeout)
            try:
                await fut
            finally:
                timer.cancel()
        return fut.result()

    def _post(self, req: Req) -> bool:
        """Send ``req`` and drop its reply when it comes (``calls.Post``): True.  False, and
        nothing sent, where the in-flight window has no room for it and one more request
        (the caller then waits for it as for any request)."""
        conn = self._conn
        if conn is None or conn.in_flight + 2 > self.limits.max_in_flight:
            return False
        self._send(req).add_done_callback(_drop_reply)
        return True

    async def _exec(self, req: Req):
        fut = self._send(req)
        reply = await self._wait(fut, time.monotonic() + self.timeout)
        reply.raise_for_status()
        return req.finish(reply)

    async def _exec_many(self, reqs: list[Req], combine: Callable[[list], Any]):
        futs: list[asyncio.Future] = []
        deadline = time.monotonic() + self.timeout
        for req in reqs:
            while self._conn is not None and self._conn.in_flight >= self.limits.max_in_flight:
                mine = [f for f in futs if not f.done()]
                if mine:
                    await self._wait(mine[0], deadline)
                elif time.monotonic() > deadline:
                    raise Timeout(f"no room to send within {self.timeout} s")
                else:
                    await asyncio.sleep(0.001)      # the window is held by other callers
            futs.append(self._send(req))
        results = []
        for req, fut in zip(reqs, futs):
            reply = await self._wait(fut, deadline)
            reply.raise_for_status()
            results.append(req.finish(reply))
        return combine(results)

    async def call(self, opcode: int, header: bytes = b"", views: Sequence[Any] = (), *, flags: int = 0,
                   into: Any = None, timeout: Optional[float] = None) -> Reply:
        """One raw request (the node-to-node ops of cluster/ use it): the OK reply, or its
        error raised; ``into`` as in ``ClientProtocolConnection.send_request``."""
        fut = self._send(Req(opcode, header, views, flags, into, None))
        reply = await self._wait(fut, time.monotonic() + (self.timeout if timeout is None else timeout))
        return reply.raise_for_status()

    async def ls(self, scope, prefix_hash: "str | None" = None) -> list[KvBlockKey]:
        prefix = self._scope_prefix(scope, prefix_hash)
        out: list[KvBlockKey] = []
        after = b""
        while True:
            page = await self._exec(self._list_req(prefix, after))
            out += [decode_key(k) for k in page.keys]
            if not page.more or not page.keys:
                return out
            after = page.keys[-1]

    async def ping(self) -> float:
        t0 = time.perf_counter()
        await self._exec(self._ping_req())
        return time.perf_counter() - t0
