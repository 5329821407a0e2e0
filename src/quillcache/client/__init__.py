"""The QuillCache client library: ``Client`` (blocking socket) and ``AsyncClient`` (asyncio).

    from quillcache import Client, KvBlockKey
    with Client("127.0.0.1:7470", token=None, timeout=10.0) as c:
        c.put(key, data)
        n = c.get_into(key, numpy_array)      # received straight into the array

Both sit on the sans-I/O ``ClientProtocolConnection``: the sync client reads with
``recv_into`` straight into the buffer the parser hands out (the caller's buffer for
``get_into``), the async one is an ``asyncio.BufferedProtocol``.  Requests are
pipelined (``get_many``/``put_many``/``exists_many`` send every request before waiting),
replies matched by id.  Errors are the ``quillcache.errors`` classes of the server's
status; a dropped connection is ``ConnectionLost``; every wait has a deadline
(``Timeout``).  After a ``Timeout`` the sync client closes its connection (the stream may
hold half a reply); the async one keeps it (a late reply is matched and dropped).

Which calls copy (docs/protocol.md has the table): data handed to ``put``/``put_many`` is
sent without a copy (the socket reads it in place: ``sendmsg`` of the caller's buffers) and
must not change until the call returns; ``get`` returns a ``bytes`` created uninitialised at
the reply's size and received into by ``recv_into`` before anyone sees it (one allocation,
no zero fill, no copy; the payload CRC is checked on the way); ``get_many`` returns a
``memoryview`` per value over buffers of up to ``GET_MANY_BUFFER_BYTES`` that consecutive
values are received into (no copy, no zero fill; each fresh buffer costs an mmap or heap
growth and its page faults, and buffers larger than glibc's 32 MiB mmap ceiling are never
reused from the heap); ``get_into``/``get_many_into`` receive into the caller's buffers.
Over the Unix socket with the arena mapped, ``get``/``put`` copy once out of/into the
mapping and the located calls copy nothing.

Hot-path choices: a key carries its encoding (made with the ``KvBlockKey``, no cache); the
sync client's socket is blocking with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` (one syscall per
send/recv, no poll, no timeout change per wait: the kernel timeout is lowered only when a
deadline is nearer than it); a single GET first reads just the reply's fixed header so the
payload goes from the socket straight into the destination.
"""
from quillcache.client.aio import AsyncClient
from quillcache.client.calls import DEFAULT_TIMEOUT_S, GET_MANY_BUFFER_BYTES
from quillcache.client.sync import Client
from quillcache.net import DEFAULT_ADDRESS
from quillcache.protocol.info import parse_info

__all__ = ["Client", "AsyncClient", "parse_info", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT_S",
           "GET_MANY_BUFFER_BYTES"]
