"""Async helpers of the connection: run a handler's coroutine up to its first real
suspension in the caller's loop turn, and only then give the rest of it to a task."""
from __future__ import annotations

__all__ = ["finish_in_task"]


class _Resume:
    """Awaitable that finishes a coroutine which already yielded ``fut`` to its runner: the
    task waits on ``fut`` and then drives the rest, as if it had run the coroutine itself."""

    __slots__ = ("coro", "fut")

    def __init__(self, coro, fut) -> None:
        self.coro = coro
        self.fut = fut

    def __await__(self):
        coro, fut = self.coro, self.fut
        self.coro = self.fut = None
        while True:
            try:
                value = yield fut
            except BaseException as exc:        # the task was cancelled (or the wait raised)
                try:
                    fut = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    fut = coro.send(value)
                except StopIteration as stop:
                    return stop.value



async def finish_in_task(coro, fut):
    """The rest of ``coro``, which already yielded ``fut``: wrap it in a task (``create_task``)."""
    return await _Resume(coro, fut)
