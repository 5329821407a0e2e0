"""node/located.py against a real quillcached: a GET_LOCATED batch is held by one store lease
(``BatchLease``) whatever its size; the guard still answers per key; RELEASE ends the batch whole.
(Expiry, kill -9 of a holder and the guard across tenants: tests/test_client_shm.py.)"""
from __future__ import annotations

import time

import numpy as np

from quillcache import Client, KvBlockKey
from tests._support.daemon import Daemon

BLOCK = 16 << 10


def key(i: int, model: str = "m") -> KvBlockKey:
    return KvBlockKey(model, "tok", None, "t0", "p", f"b{i}", 0, 16)


def content(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def info(d: Daemon) -> dict:
    with Client(d.addr) as c:
        return c.info()


def unix_client(d: Daemon) -> Client:
    sock = d.data_dir / "quillcached.sock"
    deadline = time.monotonic() + 10
    while not sock.exists():                      # the Unix socket may come just after TCP
        assert time.monotonic() < deadline, "no Unix socket"
        time.sleep(0.02)
    return Client(f"unix:{sock}")


def test_one_store_lease_holds_a_whole_batch_and_release_ends_it(tmp_path):
    with Daemon(tmp_path) as d, unix_client(d) as u:
        assert u.shm
        u.put_many([(key(i), content(i)) for i in range(200)])
        u.put(key(500, model="other"), content(500))             # same tenant, another model
        keys = [key(i) for i in range(200)] + [key(500), key(999)]
        with u.get_many_located(keys) as views:
            now = info(d)
            assert now["Store"]["leases"] == 1                     # one lease object for 200 blocks
            assert now["Server"]["located_leases"] == 200          # ... holding each of them
            assert [bytes(v) for v in views[:200]] == [content(i) for i in range(200)]
            assert views[200] is None and views[201] is None       # the guard's miss, a plain miss
        after = info(d)
        assert after["Store"]["leases"] == 0 and after["Server"]["located_leases"] == 0
        assert after["Guard"]["reuse_refused_model"] == 1         # the guard ran on that key
