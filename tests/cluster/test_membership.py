"""Membership against a real etcd: stopping a node with an idle watch is prompt."""
import asyncio
import time

from quillcache.cluster.membership import Membership


def test_stop_with_an_idle_watch_returns_at_once(etcd):
    # Closing a watch response alone waits until etcd sends something on the stream, which an
    # idle prefix may not do for a long time (the node's own record refresh is 10 s away): the
    # stop must shut the stream's socket down, not wait for the next event.
    loop = asyncio.new_event_loop()
    try:
        m = Membership(endpoints=[(etcd.host, etcd.port)], cluster_id="stop", node_id="n1",
                       address="127.0.0.1:1", ttl=3.0, version="test",
                       space=lambda: (1 << 20, 1 << 20), loop=loop,
                       on_change=lambda view, state: None)
        m.start()
        assert m.registered.wait(10), "never registered"
        deadline = time.monotonic() + 10
        while (m._watch_thread is None or not m._watch_thread.is_alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        watcher = m._watch_thread
        assert watcher is not None and watcher.is_alive(), "no watch stream"
        time.sleep(1.0)                                  # the stream is idle now
        t0 = time.monotonic()
        m.stop(timeout=5.0)
        watcher.join(5.0)
        took = time.monotonic() - t0
        assert not watcher.is_alive(), "the watch thread outlived stop()"
        assert took < 1.5, f"stop took {took:.2f} s"
        assert m.state == "stopped"
    finally:
        loop.close()


def _member(etcd, loop, address, node_id="n1", cluster_id="dup", ttl=2.0):
    return Membership(endpoints=[(etcd.host, etcd.port)], cluster_id=cluster_id, node_id=node_id,
                      address=address, ttl=ttl, version="test", space=lambda: (1 << 20, 1 << 20),
                      loop=loop, on_change=lambda view, state: None)


def _record(etcd, cluster_id, node_id="n1"):
    import base64
    import json

    import requests
    key = base64.b64encode(f"/quillcache/{cluster_id}/nodes/{node_id}".encode()).decode()
    kvs = requests.post(f"http://{etcd.host}:{etcd.port}/v3/kv/range", json={"key": key}, timeout=5).json().get("kvs")
    return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_node_id_held_by_another_live_node_is_not_taken_over(etcd):
    # Two nodes given one id: the second must not overwrite the first's record (the pool
    # would see the id flap between two addresses and epochs); it says why and waits.
    loop = asyncio.new_event_loop()
    first = _member(etcd, loop, "127.0.0.1:1111")
    second = _member(etcd, loop, "127.0.0.1:2222")
    try:
        first.start()
        assert first.registered.wait(10)
        second.start()
        assert _wait(lambda: second.state == "conflict", 10), second.state
        assert "127.0.0.1:1111" in second.conflict and not second.registered.is_set()
        time.sleep(2.5)                                   # more than a TTL: retries change nothing
        rec = _record(etcd, "dup")
        assert rec["address"] == "127.0.0.1:1111" and rec["epoch"] == first.epoch
        assert first.state == "ok" and second.stats()["conflicts"] == 1
        # The first one leaves: the second registers under the name within a retry.
        first.stop()
        assert second.registered.wait(5), second.state
        assert _wait(lambda: second.state == "ok", 5) and second.conflict == ""
        assert _record(etcd, "dup")["address"] == "127.0.0.1:2222"
    finally:
        second.stop()
        first.stop()
        loop.close()


def test_an_earlier_run_at_the_same_address_is_replaced_at_once(etcd):
    # A node killed without revoking its lease and started again: its old record (same
    # address, alive for up to a TTL) is replaced at once, not waited out.
    loop = asyncio.new_event_loop()
    old = _member(etcd, loop, "127.0.0.1:3333", cluster_id="rerun", ttl=30.0)
    new = None
    try:
        old.start()
        assert old.registered.wait(10)
        old._stop.set()                                   # dies: no keepalive, no revoke
        old._close_watch()
        old._thread.join(5)
        new = _member(etcd, loop, "127.0.0.1:3333", cluster_id="rerun", ttl=30.0)
        t0 = time.monotonic()
        new.start()
        assert new.registered.wait(5) and _wait(lambda: new.state == "ok", 5)
        assert time.monotonic() - t0 < 3.0               # not the 30 s the old lease has left
        assert _record(etcd, "rerun")["epoch"] == new.epoch
    finally:
        if new is not None:
            new.stop()
        loop.close()


def test_an_engine_id_registered_by_another_engine_is_refused_and_freed_later(etcd):
    from quillcache.cluster.engines import EngineRegistration

    def reg(url):
        return EngineRegistration(endpoints=[(etcd.host, etcd.port)], cluster_id="eng", ttl=2.0,
                                  record={"id": "e0", "url": url, "model": "m"})

    first, second = reg("http://127.0.0.1:8001"), reg("http://127.0.0.1:8002")
    try:
        first.start()
        assert first.registered.wait(10)
        second.start()
        assert _wait(lambda: second.state == "conflict", 10), second.state
        assert "8001" in second.conflict
        first.stop()
        assert second.registered.wait(5)
        # a rerun of the second engine's registrant (same url) takes its record back at once
        third = reg("http://127.0.0.1:8002")
        third.start()
        assert third.registered.wait(5) and _wait(lambda: third.state == "ok", 5)
        third.stop()
    finally:
        second.stop()
        first.stop()


def test_signed_engine_records_are_seen_and_made_up_ones_refused(etcd):
    # With the pool's keys, a watch sees the engines that signed their records and refuses
    # one an etcd writer made up, or one copied under another engine's name.
    import base64
    import json

    import requests

    from quillcache.cluster.engines import EngineRegistration, EngineWatch
    from quillcache.cluster.keys import ClusterKeys

    keys = ClusterKeys("engine-test-credential-0123", "eng2")
    ep = [(etcd.host, etcd.port)]

    def put(name, value):
        requests.post(f"http://{etcd.host}:{etcd.port}/v3/kv/put", timeout=5, json={
            "key": base64.b64encode(f"/quillcache/eng2/engines/{name}".encode()).decode(),
            "value": base64.b64encode(value).decode()}).raise_for_status()

    loop = asyncio.new_event_loop()
    reg = EngineRegistration(endpoints=ep, cluster_id="eng2", ttl=3.0, keys=keys,
                             record={"id": "e0", "url": "http://127.0.0.1:8001", "model": "m"})
    watch = EngineWatch(endpoints=ep, cluster_id="eng2", loop=loop, on_change=lambda v, s: None, keys=keys)
    try:
        reg.start()
        assert reg.registered.wait(10)
        put("evil", json.dumps({"id": "evil", "url": "http://127.0.0.1:6666", "model": "m"}).encode())
        signed = base64.b64decode(requests.post(f"http://{etcd.host}:{etcd.port}/v3/kv/range", timeout=5, json={
            "key": base64.b64encode(b"/quillcache/eng2/engines/e0").decode()}).json()["kvs"][0]["value"])
        put("copy", signed)
        watch.start()
        assert _wait(lambda: "e0" in watch.view, 10), watch.view
        time.sleep(0.5)
        assert set(watch.view) == {"e0"} and watch.view["e0"]["url"] == "http://127.0.0.1:8001"
        assert watch.stats()["records_refused"] >= 2
    finally:
        watch.stop()
        reg.stop()
        loop.close()
