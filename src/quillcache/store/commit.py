"""An asyncio group committer over the native WalWriter.

Submitters hand in encoded WAL records; one task on the event loop collects them into
batches and hands each batch to a dedicated commit thread, which runs the owner's
``before_commit`` hook (the SSD tier's data-file fdatasync), appends the records and calls
``WalWriter.commit()`` (one vectored write + linked fdatasync, GIL released).  Back on the
loop, each record's ``on_durable(lsn)`` callback runs in append order, then its submitter
is released with the callback's result.  Every record appended before a commit is
released by that commit; the event loop never blocks on disk.

A failed commit (or a failed ``before_commit``) is fatal: that batch and every later
submit raise ReadOnlyError.
"""
from __future__ import annotations

import asyncio
import collections
import errno
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from quillcache import faults
from quillcache._native import wal as _wal
from quillcache.errors import InvalidArgument, ReadOnlyError

__all__ = ["GroupCommitter", "MAX_BATCH_RECORDS", "LATENCY_SAMPLES"]

MAX_BATCH_RECORDS = 4096      # records: the most one group commit carries
LATENCY_SAMPLES = 4096        # commits: latency samples kept for p50/p99

OnDurable = Optional[Callable[[int], Any]]


class GroupCommitter:
    """GroupCommitter(wal, *, window_s=0.001, sync="group", before_commit=None, after_batch=None)

    ``before_commit(data_sync: bool)`` runs in the commit thread before the batch's records
    are appended (data_sync is True when some record of the batch asked for it).
    ``after_batch(lsn)`` is a coroutine function awaited on the loop after a batch was
    applied and before the next one starts (the SSD tier checkpoints there).
    ``sync="always"``: one record per commit, no window.
    """

    def __init__(self, wal, *, window_s: float = 0.001, sync: str = "group",
                 before_commit: Optional[Callable[[bool], None]] = None,
                 after_batch: Optional[Callable[[int], Any]] = None,
                 max_batch: int = MAX_BATCH_RECORDS) -> None:
        if sync not in ("group", "always"):
            raise InvalidArgument(f"sync must be 'group' or 'always', got {sync!r}")
        if not 0 <= window_s <= 1.0:
            raise InvalidArgument(f"commit_window_s must be in [0, 1] seconds, got {window_s!r}")
        if not 1 <= max_batch <= MAX_BATCH_RECORDS:
            raise InvalidArgument(f"max_batch must be in [1, {MAX_BATCH_RECORDS}], got {max_batch!r}")
        self.wal = wal
        self.sync = sync
        self.window_s = 0.0 if sync == "always" else window_s
        self.max_batch = 1 if sync == "always" else max_batch
        self._before_commit = before_commit
        self._after_batch = after_batch
        # one commit at a time: the committer thread and the owner's inline (sync) commits
        self.lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._wakeup: Optional[asyncio.Future] = None
        self._task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._closing = False
        self.failed: Optional[BaseException] = None
        self.applied_lsn = wal.durable_lsn
        self.commits = 0
        self.records = 0
        self._latency = collections.deque(maxlen=LATENCY_SAMPLES)   # seconds per commit

    # -- the commit itself (any thread) -------------------------------------------------------
    def commit_now(self, records, data_sync: bool) -> int:
        """Append ``records`` and commit them inline (blocking); returns the durable lsn."""
        self._check()
        t0 = time.perf_counter()
        with self.lock:
            try:
                if self._before_commit is not None:
                    # data before metadata: the blocks a record points at are durable first
                    self._before_commit(data_sync)
                for rec in records:
                    self.wal.append(rec)
                faults.killpoint("after_wal_append")
                if faults.FAULTS_ENABLED:
                    if faults.fire("wal_fsync_eio"):
                        _wal.set_fault("fsync", errno.EIO)
                    if faults.fire("wal_enospc"):
                        _wal.set_fault("enospc", 1)
                lsn = self.wal.commit()
            except ReadOnlyError as exc:
                self.failed = exc
                raise
            except OSError as exc:
                self.failed = ReadOnlyError(f"commit failed: {exc}; the SSD tier is read-only")
                raise self.failed from exc
            faults.killpoint("after_wal_fsync")
            faults.journal_lsn(lsn)
        self.commits += 1
        self.records += len(records)
        self._latency.append(time.perf_counter() - t0)
        return lsn

    def _check(self) -> None:
        if self.failed is not None:
            raise ReadOnlyError(f"the SSD tier is read-only after an earlier failure: {self.failed}")

    # -- asyncio side ---------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None:
            if self._loop is not loop:
                raise InvalidArgument("the SSD tier's committer runs on another event loop")
            return
        if self._closing:
            raise InvalidArgument("the committer is closed")
        self._loop = loop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qc-commit")
        self._task = loop.create_task(self._run(), name="quillcache-ssd-committer")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit_nowait(self, record: bytes, on_durable: OnDurable = None,
                      data_sync: bool = False) -> asyncio.Future:
        """Queue one record; the returned future gets on_durable(lsn)'s result (or the lsn)."""
        self._check()
        self._ensure_started()
        fut = self._loop.create_future()
        self._queue.append((record, on_durable, data_sync, fut))
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        return fut

    async def submit(self, record: bytes, on_durable: OnDurable = None, data_sync: bool = False):
        return await self.submit_nowait(record, on_durable, data_sync)

    async def _run(self) -> None:
        loop = self._loop
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wakeup = loop.create_future()
                await self._wakeup
                continue
            if self.window_s > 0 and len(self._queue) < self.max_batch:
                await asyncio.sleep(self.window_s)     # let concurrent puts join this commit
            n = min(len(self._queue), self.max_batch)
            batch = [self._queue.popleft() for _ in range(n)]
            records = [b[0] for b in batch]
            data_sync = any(b[2] for b in batch)
            try:
                lsn = await loop.run_in_executor(self._executor, self.commit_now, records, data_sync)
            except BaseException as exc:                # handed to every submitter
                err = exc if isinstance(exc, ReadOnlyError) else ReadOnlyError(str(exc))
                if self.failed is None:
                    self.failed = err
                for _, _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                self._fail_queued()
                continue
            # publish in append order, before anyone is released (readers see durable state only)
            for _, on_durable, _, fut in batch:
                try:
                    result = on_durable(lsn) if on_durable is not None else lsn
                except Exception as exc:                # the submitter gets it
                    if not fut.done():
                        fut.set_exception(exc)
                    continue
                if not fut.done():
                    fut.set_result(result)
            self.applied_lsn = lsn
            if self._after_batch is not None:
                await self._after_batch(lsn)

    def _fail_queued(self) -> None:
        while self._queue:
            _, _, _, fut = self._queue.popleft()
            if not fut.done():
                fut.set_exception(self.failed)

    async def run_in_thread(self, fn, *args):
        """Run ``fn`` on the commit thread (serialised with commits)."""
        self._ensure_started()
        return await self._loop.run_in_executor(self._executor, fn, *args)

    async def close(self) -> None:
        """Commit what is queued, then stop the task and the thread."""
        self._closing = True
        if self._task is not None:
            if self._wakeup is not None and not self._wakeup.done():
                self._wakeup.set_result(None)
            try:
                await self._task
            finally:
                self._executor.shutdown(wait=True)
                self._task = None

    def latency(self) -> dict:
        """Commit latency percentiles in milliseconds over the last LATENCY_SAMPLES commits."""
        samples = sorted(self._latency)
        if not samples:
            return {"commit_p50_ms": 0.0, "commit_p99_ms": 0.0}

        def pct(p: float) -> float:
            return round(samples[min(len(samples) - 1, int(p * len(samples)))] * 1000.0, 3)
        return {"commit_p50_ms": pct(0.50), "commit_p99_ms": pct(0.99)}
