"""The node under pressure, through the real daemon: bursts far larger than DRAM lose no
put while the SSD tier has room (puts wait for demotions), and reads of SSD-only blocks
never stall the event loop for the other connections."""
from __future__ import annotations

import asyncio
import multiprocessing
import random
import threading
import time

import pytest

from quillcache import AsyncClient, Client
from tests._support.daemon import Daemon
from tests._support.data import content, key
from tests._support.metrics import metric_value, scrape

MiB = 1 << 20


def _sizes(client: int, total: int, rng: random.Random) -> list[int]:
    """Block sizes summing to about ``total``: 1 MiB blocks, or random sizes (even clients)."""
    out, left = [], total
    while left > 0:
        size = MiB if client % 2 else rng.randint(1, 2 * MiB)
        out.append(min(size, left))
        left -= out[-1]
    return out


def _burst(addr: str, client: int, total: int, durable: bool, batch: int, done: dict, errors: list) -> None:
    """One client putting ``total`` bytes as fast as it can (put, or put_many of ``batch``)."""
    rng = random.Random(client)
    items = [(key(client * 100_000 + i, prefix=f"c{client}"), content(client * 100_000 + i, n))
             for i, n in enumerate(_sizes(client, total, rng))]
    try:
        with Client(addr, timeout=60) as c:
            if batch > 1:
                for i in range(0, len(items), batch):
                    c.put_many(items[i:i + batch], durable=durable)
            else:
                for k, data in items:
                    c.put(k, data, durable=durable)
    except Exception as exc:          # reported by the test thread
        errors.append(exc)
    done[client] = items


def _run_burst(d: Daemon, clients: int, total: int, *, durable=False, batch=1) -> dict:
    done: dict = {}
    errors: list = []
    threads = [threading.Thread(target=_burst, args=(d.addr, i, total, durable, batch if i % 4 == 3 else 1,
                                                     done, errors)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return done


def _read_back(d: Daemon, done: dict) -> tuple[int, int]:
    """(blocks, blocks whose bytes came back exactly)."""
    n = good = 0
    with Client(d.addr, timeout=60) as c:
        for items in done.values():
            for k, data in items:
                n += 1
                good += c.get(k) == data
    return n, good


def test_eight_clients_bursting_ten_times_dram_lose_no_block(tmp_path):
    """8 clients, 1 MiB and random-size blocks (some in PUT_MANY), 10x the DRAM: all read back."""
    with Daemon(tmp_path, ssd=True, dram="24MiB", max_block="4MiB", ssd_capacity="512MiB",
                direct_io=True) as d:
        done = _run_burst(d, 8, 30 * MiB, batch=4)                     # 240 MiB in all
        n, good = _read_back(d, done)
        with Client(d.addr) as c:
            store = c.info()["Store"]
        assert (good, store["dropped_dirty"]) == (n, 0)
        assert store["put_waits"] > 0 and store["put_wait_timeouts"] == 0
        deadline = time.monotonic() + 10          # /metrics shows the snapshot of the last maintenance
        while metric_value(scrape(d.metrics_port), "quillcache_store_put_waits_total") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        text = scrape(d.metrics_port)
        assert metric_value(text, "quillcache_store_put_wait_seconds_total") > 0
        assert metric_value(text, "quillcache_store_dropped_dirty_total") == 0


def test_issue_repro_160_puts_of_1mib_into_64mib_of_dram_all_read_back(tmp_path):
    with Daemon(tmp_path, ssd=True, dram="64MiB", ssd_capacity="1GiB", direct_io=True) as d, \
            Client(d.addr, timeout=60) as c:
        for i in range(160):
            c.put(key(i), content(i, MiB))
        assert sum(c.get(key(i)) == content(i, MiB) for i in range(160)) == 160
        assert c.info()["Store"]["dropped_dirty"] == 0


@pytest.mark.parametrize("policy,durable", [("write_through", False), ("write_back", True)])
def test_durable_bursts_from_four_clients_lose_no_block(tmp_path, policy, durable):
    with Daemon(tmp_path, ssd=True, dram="16MiB", max_block="4MiB", ssd_capacity="256MiB",
                sections={"store": f'policy = "{policy}"'}) as d:
        done = _run_burst(d, 4, 40 * MiB, durable=durable, batch=4)     # 10x the DRAM
        n, good = _read_back(d, done)
        with Client(d.addr) as c:
            store = c.info()["Store"]
        assert (good, store["dropped_dirty"]) == (n, 0)


def test_pipelined_puts_from_many_connections_lose_no_block(tmp_path):
    """4 asyncio connections, each with 16 PUTs in flight at once: 8x the DRAM."""
    async def writer(addr, c_id):
        async with AsyncClient(addr, timeout=60) as c:
            ids = [c_id * 1000 + i for i in range(32)]
            await asyncio.gather(*(c.put(key(i), content(i, MiB)) for i in ids[:16]))
            await asyncio.gather(*(c.put(key(i), content(i, MiB)) for i in ids[16:]))
            return ids

    async def scenario(addr):
        return [i for ids in await asyncio.gather(*(writer(addr, w) for w in range(4))) for i in ids]

    with Daemon(tmp_path, ssd=True, dram="16MiB", ssd_capacity="256MiB", direct_io=True) as d:
        ids = asyncio.run(scenario(d.addr))
        with Client(d.addr, timeout=60) as c:
            assert sum(c.get(key(i)) == content(i, MiB) for i in ids) == len(ids) == 128
            assert c.info()["Store"]["dropped_dirty"] == 0


def _ssd_readers(addr: str, threads: int, seconds: float, out) -> None:
    """GET SSD-only blocks 0..15 from ``threads`` connections for ``seconds``; send latencies."""
    expected = {i: content(i, MiB) for i in range(16)}
    lat: list[float] = []
    stop = time.monotonic() + seconds

    def reader(first):
        with Client(addr, timeout=60) as rc:
            i = first
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                ok = rc.get(key(i)) == expected[i]
                lat.append(time.perf_counter() - t0 if ok else -1.0)
                i = (i + threads) % 16
    pool = [threading.Thread(target=reader, args=(r,)) for r in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.send(lat)


def _p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * (len(samples) - 1))]


@pytest.mark.parametrize("backend", ["io_uring", "pool"])
def test_slow_ssd_reads_do_not_stall_dram_gets_on_another_connection(tmp_path, backend):
    """200 ms injected per SSD read (a timeout linked before each io_uring read, or a sleep
    in a pool thread); DRAM GETs on another connection keep p99 under 10 ms, on both paths."""
    env = {"QUILLCACHE_SSD_READ_DELAY_MS": "200", "QUILLCACHE_NO_URING": "1" if backend == "pool" else "0"}
    with Daemon(tmp_path, ssd=True, dram="8MiB", ssd_capacity="128MiB", direct_io=False,
                sections={"ssd": "promote_on_get = false", "store": 'policy = "write_through"'},
                env=env) as d:
        with Client(d.addr, timeout=60) as c:
            for i in range(40):                     # 40 MiB into 8 MiB: the first ones are on SSD only
                c.put(key(i), content(i, MiB))
            c.put(key(999), b"hot" * 1000)           # the most recent: stays in DRAM
            tiers = c.info()["Tiers"]
            assert tiers["dram_blocks"] <= 8
            if tiers["ssd_read_backend"] != backend:
                assert backend == "io_uring" and tiers["ssd_read_backend"] == "pool"
                pytest.skip("io_uring is refused on this machine (the daemon logged why)")
        # The SSD readers run in another process: their GIL is not the measuring thread's.
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        readers = ctx.Process(target=_ssd_readers, args=(d.addr, 4, 4.0, child))
        readers.start()
        try:
            time.sleep(0.5)
            lat = []
            with Client(d.addr, timeout=60) as c:
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    assert c.get(key(999)) == b"hot" * 1000
                    lat.append(time.perf_counter() - t0)
                    time.sleep(0.005)
            assert parent.poll(30)
            slow_gets = parent.recv()
        finally:
            readers.join(30)
            if readers.is_alive():
                readers.kill()
        assert len(slow_gets) >= 20 and min(slow_gets) >= 0.2   # the fault was on: each SSD read 200 ms
        assert len(lat) > 100 and _p99(lat) < 0.010, f"p99 {_p99(lat) * 1e3:.1f} ms over {len(lat)} GETs"
