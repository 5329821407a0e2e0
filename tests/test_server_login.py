"""The node's connection admission, idle timeout and rate-limited logging (node/admission.py,
node/connection.py): the parts alone against simple oracles, then over a real quillcached."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from quillcache import Client
from quillcache.errors import ConnectionLost, QuillCacheError
from quillcache.node.admission import Admission, RateLimitedLog
from quillcache.store.leases import release_leases
from tests._support.daemon import Daemon


class Waiting:
    """A connection waiting to log in, as ``Admission`` sees one (``evict`` closes it)."""

    def __init__(self, name: str, open_set: set) -> None:
        self.name = name
        self.open_set = open_set
        self.evicted = False

    def evict(self) -> int:
        self.evicted = True
        held = int(self in self.open_set)
        self.open_set.discard(self)
        return held


def _admit(adm: Admission, open_set: set, name: str, source: str):
    conn = Waiting(name, open_set)
    refused = adm.admit(conn, source, len(open_set))
    if refused is None:
        open_set.add(conn)
    return conn, refused


def test_a_source_at_its_limit_pushes_out_its_own_oldest_never_another_sources():
    adm, open_set = Admission(100, 40, 3), set()
    other, _ = _admit(adm, open_set, "other", "10.0.0.9")
    mine = [_admit(adm, open_set, f"m{i}", "10.0.0.1")[0] for i in range(5)]
    assert [c.evicted for c in mine] == [True, True, False, False, False]
    assert not other.evicted and adm.waiting_from("10.0.0.1") == 3 and len(adm) == 4
    assert adm.stats()["unauthenticated_evicted_same_source"] == 2


def test_a_limit_of_one_per_source_keeps_exactly_the_newest():
    adm, open_set = Admission(100, 40, 1), set()
    conns = [_admit(adm, open_set, f"m{i}", "10.0.0.1")[0] for i in range(3)]
    assert [c.evicted for c in conns] == [True, True, False] and adm.waiting_from("10.0.0.1") == 1
    adm.remove(conns[2])
    assert len(adm) == 0 and adm.waiting_from("10.0.0.1") == 0


def test_the_shared_pool_and_the_node_slots_push_out_the_oldest_waiting_and_logged_in_keep_theirs():
    adm, open_set = Admission(8, 100, 100), set()       # at most half of 8 may wait: 4
    assert adm.max_unauthenticated == 4
    waiting = [_admit(adm, open_set, f"w{i}", f"10.0.0.{i}")[0] for i in range(6)]
    assert [c.evicted for c in waiting] == [True, True, False, False, False, False]
    for c in waiting[2:]:                               # these log in: no longer waiting
        adm.remove(c)
    logged_in = set(waiting[2:])
    newer = [_admit(adm, open_set, f"n{i}", f"10.0.1.{i}")[0] for i in range(4)]
    assert len(open_set) == 8 and not any(c.evicted for c in newer)
    last, refused = _admit(adm, open_set, "last", "10.0.2.1")      # every slot taken: the oldest waiting goes
    assert refused is None and newer[0].evicted and len(open_set) == 8
    for c in newer[1:] + [last]:
        adm.remove(c)
    _, refused = _admit(adm, open_set, "none-left", "10.0.3.1")     # all 8 slots logged in: Busy
    assert refused is not None and refused[0] == "max_connections"
    assert logged_in <= open_set


def test_the_bad_input_log_lets_a_burst_through_then_counts_what_it_drops(caplog):
    now = [0.0]
    logger = logging.getLogger("quillcache.test_ratelimit")
    lim = RateLimitedLog(logger, burst=5, per_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=logger.name):
        for i in range(100):
            lim.log(logging.INFO, "bad frame %d", i)
        assert len(caplog.records) == 5 and lim.suppressed == 95
        now[0] += 1.0
        lim.flush()
        assert "95 log lines about bad input suppressed" in caplog.records[-1].getMessage()
        now[0] += 1.0
        lim.log(logging.INFO, "bad frame %d", 100)
        assert caplog.records[-1].getMessage() == "bad frame 100"
        for _ in range(10):
            lim.log(logging.INFO, "x")
        now[0] += 1.0
        lim.log(logging.INFO, "again")
        assert caplog.records[-1].getMessage().startswith("again (and ")
    assert lim.suppressed_total == 95 + 10


def test_release_leases_releases_the_leases_and_skips_every_kind_of_miss():
    from quillcache.errors import NotFound
    from quillcache.store.options import StoreOptions
    from quillcache.store.tiers import LocalKvStore
    from tests._support.data import key

    async def run() -> None:
        store = LocalKvStore(StoreOptions(dram_bytes=1 << 20))
        try:
            await store.put(key(1), b"a")
            await store.put(key(2), b"b")
            leases = [store.get_nowait(key(1)), store.get_nowait(key(2))]
            got = [leases[0], NotFound("x"), 3, None, leases[1]]   # GET_MANY, GET_LOCATED, SSD misses
            assert release_leases(got) == 2
            assert all(lease.released for lease in leases)
            assert release_leases(got) == 2                 # twice is harmless
            assert store.stats()["store"]["leases"] == 0
        finally:
            await store.close()

    asyncio.run(run())


# --------------------------------------------------------------------------- over the wire


def test_an_idle_connection_is_closed_after_idle_timeout_and_a_busy_one_is_not(tmp_path):
    with Daemon(tmp_path, sections={"node": 'idle_timeout = "2s"'}) as d:
        idle = Client(d.addr)
        busy = Client(d.addr)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5.0:
                busy.ping()
                time.sleep(0.2)
            with pytest.raises((ConnectionLost, QuillCacheError)):
                idle.ping()
            busy.ping()
            assert "idle for" in d.log()
        finally:
            idle.close()
            busy.close()


def test_idle_timeout_zero_keeps_quiet_connections(tmp_path):
    with Daemon(tmp_path, sections={"node": 'idle_timeout = "0s"'}) as d, Client(d.addr) as c:
        time.sleep(3.0)
        c.ping()
