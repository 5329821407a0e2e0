"""NIXL scenarios for tests/transfer/test_nixl.py, each run in a process of its own
(``python -m tests._support.nixl_scenarios NAME``).

NIXL 1.5.1's wheel crashes in an ELF destructor at process exit once an agent was made (its
bundled libnl-route: ``rtnl_tc_unregister`` in ``_dl_fini``, SIGSEGV after ``main`` returned).
So a process that made an agent ends with ``os._exit`` after its own work, and the pytest
process never makes one.  A scenario prints ``OK`` when every check held and exits 0; a failed
check is an ``AssertionError`` and exit 1.
"""
from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np

from quillcache.errors import InvalidArgument
from quillcache.transfer.nixl import NixlEndpoint

ARENA_BYTES = 8 << 20
_keep: list = []


def _arena(seed: int) -> np.ndarray:
    """A memfd mapping filled with known bytes, as the node's DRAM tier maps its arena."""
    fd = os.memfd_create("quillcache-test-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, ARENA_BYTES)
    m = mmap.mmap(fd, ARENA_BYTES, flags=mmap.MAP_SHARED)
    os.close(fd)
    _keep.append(m)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = np.random.default_rng(seed).integers(0, 256, ARENA_BYTES, dtype=np.uint8)
    return a


def _endpoint(name: str, seed: int, **kw) -> tuple[NixlEndpoint, np.ndarray]:
    a = _arena(seed)
    ep = NixlEndpoint(name, a, **kw)
    _keep.append(ep)
    return ep, a


async def _refused(coro, match: str = "") -> None:
    try:
        await coro
    except InvalidArgument as exc:
        assert match in str(exc), (match, str(exc))
        return
    raise AssertionError(f"not refused (wanted InvalidArgument {match!r})")


async def read_bytes() -> None:
    holder, held = _endpoint("holder-1", 1)
    reader, _ = _endpoint("reader-1", 2)
    extents = [(0, 4096), (1 << 20, 256 << 10), (ARENA_BYTES - 100, 100)]
    await reader.add_peer("a", 7, holder.metadata, holder.arena_address, holder.arena_bytes)
    with await reader.read("a", 7, extents, time.monotonic() + 10) as got:
        assert [bytes(v) for v in got.blocks] == [held[o:o + n].tobytes() for o, n in extents]
        assert reader.stats()["staging_used"] >= sum(n for _, n in extents)
    assert reader.stats()["staging_used"] == 0
    assert reader.counters["reads"] == 1 and reader.counters["read_bytes"] == 4096 + (256 << 10) + 100


async def kept_views_own_their_staging() -> None:
    """``keep()``: the blocks as read-only views that hold their staging extent until the last
    view made from them is gone (then it is given back, on the loop's thread), never before."""
    holder, held = _endpoint("holder-5", 10)
    reader, _ = _endpoint("reader-5", 11, staging_bytes=1 << 20)
    await reader.add_peer("a", 1, holder.metadata, holder.arena_address, holder.arena_bytes)
    extents = [(0, 512 << 10), (1 << 20, 512 << 10)]
    got = await reader.read("a", 1, extents, time.monotonic() + 10)
    views = got.keep()
    got.release()                                   # nothing: the views own the extent now
    assert all(v.readonly for v in views)
    assert [bytes(v) for v in views] == [held[o:o + n].tobytes() for o, n in extents]
    assert reader.stats()["staging_used"] == 1 << 20
    await _refused(reader.read("a", 1, [(0, 4096)], time.monotonic() + 5), "staging")  # full while they live
    part = views[1][10:20]
    del views
    assert reader.stats()["staging_used"] == 1 << 20, "given back while a view of it lived"
    assert bytes(part) == held[(1 << 20) + 10:(1 << 20) + 20].tobytes()
    del part
    assert reader.stats()["staging_used"] == 0
    views = (await reader.read("a", 1, [(4096, 4096)], time.monotonic() + 10)).keep()
    dropper = threading.Thread(target=views.clear)  # the last view goes on another thread
    dropper.start()
    dropper.join()
    assert reader.stats()["staging_used"] == 4096   # handed to the loop, not freed on that thread
    await asyncio.sleep(0)
    assert reader.stats()["staging_used"] == 0


async def refused_before_transfer() -> None:
    holder, _ = _endpoint("holder-2", 3)
    reader, _ = _endpoint("reader-2", 4)
    await reader.add_peer("a", 1, holder.metadata, holder.arena_address, holder.arena_bytes)
    for extents in ([(ARENA_BYTES - 10, 11)], [(-1, 10)], [(0, 0)], []):
        await _refused(reader.read("a", 1, extents, time.monotonic() + 5))
    await _refused(reader.read("a", 2, [(0, 10)], time.monotonic() + 5), "no agent")   # another run of a
    await _refused(reader.read("b", 1, [(0, 10)], time.monotonic() + 5), "no agent")   # never added
    assert reader.counters["reads"] == 0 and reader.stats()["staging_used"] == 0


async def restarted_holder() -> None:
    old, _ = _endpoint("holder-3-epoch1", 5)
    new, held_new = _endpoint("holder-3-epoch2", 6)
    reader, _ = _endpoint("reader-3", 7)
    await reader.add_peer("a", 1, old.metadata, old.arena_address, old.arena_bytes)
    await reader.add_peer("a", 2, new.metadata, new.arena_address, new.arena_bytes)
    assert reader.knows("a", 2) and not reader.knows("a", 1)
    with await reader.read("a", 2, [(4096, 4096)], time.monotonic() + 10) as got:
        assert bytes(got.blocks[0]) == held_new[4096:8192].tobytes()
    assert reader.counters["peers_removed"] == 1


async def staging_full() -> None:
    holder, _ = _endpoint("holder-4", 8)
    reader, _ = _endpoint("reader-4", 9, staging_bytes=64 << 10)
    await reader.add_peer("a", 1, holder.metadata, holder.arena_address, holder.arena_bytes)
    await _refused(reader.read("a", 1, [(0, 128 << 10)], time.monotonic() + 5), "staging")
    assert reader.counters["staging_full"] == 1 and reader.stats()["staging_used"] == 0


def _holder_process() -> None:
    """The other process: an arena of bytes i ^ 0x5A, its metadata on stdout, then wait."""
    a = _arena(0)
    a[:] = np.arange(ARENA_BYTES, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    ep = NixlEndpoint("holder-proc", a)
    sys.stdout.write(f"META {ep.arena_address} {ep.arena_bytes} {ep.metadata.hex()}\n")
    sys.stdout.flush()
    sys.stdin.readline()          # the reader is done
    ep.close()


async def other_process() -> None:
    holder = subprocess.Popen([sys.executable, "-m", "tests._support.nixl_scenarios", "_holder_process"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        while line and not line.startswith("META "):     # NIXL logs its own lines to stdout first
            line = holder.stdout.readline()
        addr, size, meta = line.split()[1:]
        reader = NixlEndpoint("reader-proc", np.zeros(1 << 20, dtype=np.uint8))
        _keep.append(reader)
        want = np.arange(ARENA_BYTES, dtype=np.uint64).astype(np.uint8) ^ 0x5A
        await reader.add_peer("h", 1, bytes.fromhex(meta), int(addr), int(size))
        extents = [(0, 256 << 10), (3 << 20, 4 << 20)]
        with await reader.read("h", 1, extents, time.monotonic() + 20) as got:
            assert all(bytes(v) == want[o:o + n].tobytes() for v, (o, n) in zip(got.blocks, extents))
        assert reader.counters["read_bytes"] == (256 << 10) + (4 << 20)
    finally:
        holder.stdin.write("done\n")
        holder.stdin.flush()
        holder.wait(30)


def main(name: str) -> None:
    code = 1
    try:
        if name == "_holder_process":
            _holder_process()
        else:
            asyncio.run(globals()[name]())
            print("OK", name, flush=True)
        code = 0
    finally:
        for obj in reversed(_keep):
            if isinstance(obj, NixlEndpoint):
                obj.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)      # past NIXL's crashing ELF destructors (see the module's docstring)


if __name__ == "__main__":
    main(sys.argv[1])
