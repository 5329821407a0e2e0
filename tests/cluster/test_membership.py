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
