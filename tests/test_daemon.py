"""The node daemon quillcached as a real process: lifecycle, signals, sd_notify, reload,
metrics, exit codes, durability across kill -9."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.service import sd_notify
from quillcache.errors import NotFound, UnsafeReuse
from quillcache.model import encode_key
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from tests._support.daemon import QUILLCACHED, Daemon
from tests._support.data import content, key
from tests._support.metrics import has_metric, metric_value, scrape
from tests._support.net import raw_connect, read_frames


# --------------------------------------------------------------------------- start-up and exit codes



def test_bad_config_on_start_exits_78_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\ndram = "12Q"\n')
    r = subprocess.run([QUILLCACHED, "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 78
    assert "[store] dram" in r.stderr and "12Q" in r.stderr


def test_write_through_without_ssd_tier_exits_78(tmp_path):
    d = Daemon(tmp_path, sections={"store": 'policy = "write_through"'})
    d.start(wait=False)
    assert d.wait(60) == 78
    assert "write_through" in d.log()


def test_a_second_daemon_on_a_locked_data_dir_exits_75_with_one_line_not_a_traceback(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Daemon(tmp_path / "a", ssd=True, data_dir=tmp_path / "shared") as first:
        second = Daemon(tmp_path / "b", ssd=True, data_dir=tmp_path / "shared")
        second.start(wait=False)
        assert second.wait(60) == 75
        log = second.log()
        assert "cannot start" in log and "locked by another writer" in log and "Traceback" not in log
        with Client(first.addr) as c:                 # the running node is untouched
            c.put(key(1), b"still here", durable=True)
            assert c.get(key(1)) == b"still here"


def test_a_corrupt_ssd_checkpoint_exits_65_naming_the_file(tmp_path):
    d = Daemon(tmp_path, ssd=True).start()
    with Client(d.addr) as c:
        c.put(key(1), content(1, 5000), durable=True)
    assert d.stop() == 0                              # a clean stop writes the checkpoint
    ckpt = d.data_dir / "ssd" / "blocks.dat.checkpoint"
    raw = bytearray(ckpt.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    ckpt.write_bytes(bytes(raw))
    d.start(wait=False)
    assert d.wait(60) == 65
    log = d.log()
    assert f"checkpoint {ckpt}" in log and "corrupt" in log and "Traceback" not in log


def test_data_dir_is_created_with_mode_0700_and_open_mode_is_logged(tmp_path):
    data = tmp_path / "fresh" / "var"
    with Daemon(tmp_path, data_dir=data) as d:
        assert data.is_dir()
        assert (data.stat().st_mode & 0o777) == 0o700
        assert "open mode (no tenants configured)" in d.log()
        assert "WAL backend:" in d.log()


# --------------------------------------------------------------------------- signals


def test_sigterm_drains_a_put_in_flight_then_exits_0(tmp_path):
    with Daemon(tmp_path) as d:
        s = raw_connect(d.port)
        k = encode_key(key(1))
        payload = content(1, 1 << 20)
        hdr = encode_frame_header(Opcode.PUT, 7, header=messages.encode_put_request(k, len(payload)),
                                  payload_length=len(payload))
        s.sendall(hdr + payload[:1000])           # the PUT is in flight, its payload half sent
        time.sleep(0.3)
        d.send(signal.SIGTERM)
        time.sleep(0.3)
        assert d.proc.poll() is None              # still draining: it waits for our PUT
        s.sendall(payload[1000:])
        frames = read_frames(s, 1)
        assert frames and frames[0].request_id == 7 and frames[0].status == 0
        assert d.wait(30) == 0
        log = d.log()
        assert "draining 1 in-flight requests" in log and "stopped" in log and "timed out" not in log


def test_sighup_reload_applies_guard_mode_and_keeps_serving(tmp_path):
    with Daemon(tmp_path) as d, Client(d.addr) as c:
        mine, other_model = key(5, model="m1"), key(5, model="m2")
        c.put(mine, b"x" * 4096)
        with pytest.raises(UnsafeReuse) as ei:
            c.get(other_model)
        assert ei.value.violation == "model"
        assert c.info("Guard")["Guard"]["mode"] == "strict"
        d.write_config(sections={"guard": 'mode = "tenant"'})
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while c.info("Guard")["Guard"]["mode"] != "tenant" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get(other_model) == b"x" * 4096  # tenant mode: same-tenant reuse is served
        assert "reload: applied guard.mode" in d.log()
        # a bad file on reload is logged and the running configuration kept
        d.config.write_text('[guard]\nmode = "sloppy"\n')
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload refused" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "reload refused" in d.log()
        assert c.info("Guard")["Guard"]["mode"] == "tenant"
        assert c.ping() >= 0
        assert d.stop() == 0


def test_sighup_reports_settings_that_need_a_restart(tmp_path):
    with Daemon(tmp_path) as d:
        d.write_config(dram="128MiB", sections={"store": 'lease = "20s"'})
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "need a restart" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = d.log()
        assert "need a restart (not applied): store.dram" in log
        assert "reload: applied store.lease=20.0" in log


def test_a_sighup_while_the_node_starts_is_held_and_applied_not_fatal(tmp_path):
    """The TCP port and the Unix socket listen before start() returns; a reload sent by
    whoever sees them (a probe, an operator, this suite's harness) must not take HUP's
    default action (exit) and is applied once the node is up."""
    d = Daemon(tmp_path)
    d.start(wait=False)
    sock = d.data_dir / "quillcached.sock"
    deadline = time.monotonic() + 60
    while not sock.exists() and d.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    d.write_config(sections={"store": 'lease = "20s"'})
    d.send(signal.SIGHUP)                             # lands during start or just after it
    try:
        d.wait_ready()
        deadline = time.monotonic() + 10
        while "reload: applied" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.proc.poll() is None, d.log()
        assert "reload: applied store.lease=20.0" in d.log()
        with Client(d.addr) as c:
            assert c.ping() >= 0
    finally:
        assert d.stop() == 0


def test_sighup_applies_the_login_deadline_and_the_idle_timeout_to_the_running_node(tmp_path):
    from quillcache.settings.convert import hash_token
    from tests._support.net import raw_connect, read_frames
    auth = f'\n[auth]\n[[auth.tenants]]\nname = "a"\ntoken = "{hash_token("t")}"\n'
    d = Daemon(tmp_path)
    d.config.write_text(d.config.read_text() + auth)
    with d, Client(d.addr, token="t") as c:
        assert c.info("Auth")["Auth"]["hello_timeout_s"] == 5.0
        d.write_config(sections={"node": 'hello_timeout = "1s"\nidle_timeout = "0s"'})
        d.config.write_text(d.config.read_text() + auth)
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while c.info("Auth")["Auth"]["hello_timeout_s"] != 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.info("Auth")["Auth"]["idle_timeout_s"] == 0.0
        s = raw_connect(d.port)
        t0 = time.monotonic()
        frames = read_frames(s, 2, timeout=10)      # the new deadline, for a connection made after
        s.close()
        assert len(frames) == 1 and frames[0].request_id == 0 and time.monotonic() - t0 < 4.0
        assert "reload: applied node.hello_timeout=1.0, node.idle_timeout=0.0" in d.log()


def test_sd_notify_ready_and_stopping_reach_a_unix_datagram_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    try:
        with Daemon(tmp_path, env={"NOTIFY_SOCKET": path}) as d:
            ready = sock.recv(4096).decode()
            assert "READY=1" in ready.split("\n") and f"MAINPID={d.proc.pid}" in ready
            d.send(signal.SIGTERM)
            assert sock.recv(4096).decode() == "STOPPING=1"
            assert d.wait(30) == 0
    finally:
        sock.close()


def test_sd_notify_handles_the_abstract_namespace():
    name = f"quillcache-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(100) == b"READY=1"
        assert not sd_notify("READY=1", {})                     # unset: nothing to do
        assert not sd_notify("READY=1", {"NOTIFY_SOCKET": "@no-such-" + name})   # logged, not raised
    finally:
        sock.close()


# --------------------------------------------------------------------------- metrics


def test_metrics_endpoint_counts_requests_by_opcode_and_status(tmp_path):
    with Daemon(tmp_path) as d, Client(d.addr) as c:
        before = metric_value(scrape(d.metrics_port), "quillcache_requests_total", 'opcode="PING",status="OK"')
        for _ in range(5):
            c.ping()
        with pytest.raises(NotFound):
            c.get(key(999))
        c.put(key(1), b"abc" * 100)
        text = scrape(d.metrics_port)
        assert metric_value(text, "quillcache_requests_total", 'opcode="PING",status="OK"') == before + 5
        assert metric_value(text, "quillcache_requests_total", 'opcode="GET",status="NOT_FOUND"') == 1
        assert metric_value(text, "quillcache_request_seconds_count", 'opcode="PUT"') == 1
        assert metric_value(text, "quillcache_received_bytes_total") >= 300
        assert 'quillcache_wal_info{backend="none"} 1.0' in text
        time.sleep(1.3)            # the store snapshot refreshes once a second
        text = scrape(d.metrics_port)
        assert metric_value(text, "quillcache_tier_capacity_bytes", 'tier="dram"') == 64 << 20
        assert metric_value(text, "quillcache_tier_used_bytes", 'tier="dram"') >= 300
        assert metric_value(text, "quillcache_tier_misses_total", 'tier="dram"') >= 1


def test_every_store_counter_is_exported_in_metrics(tmp_path):
    """The store defines its counters once (store/values.py); /metrics exports every one of
    them, each tier's and the store's: a counter added to the store cannot be left out."""
    from quillcache.store.values import SSD_COUNTERS, STORE_COUNTERS, TIER_COUNTERS
    with Daemon(tmp_path, ssd=True) as d, Client(d.addr) as c:
        c.put(key(1), b"abc" * 100)
        time.sleep(1.3)            # the store snapshot refreshes once a second
        text = scrape(d.metrics_port)
    missing = [f"{name} ({tier})" for tier in ("dram", "ssd") for name in TIER_COUNTERS
               if not has_metric(text, f"quillcache_tier_{name}_total", f'tier="{tier}"')]
    missing += [f"{name} (ssd)" for name in SSD_COUNTERS
                if not has_metric(text, f"quillcache_tier_{name}_total", 'tier="ssd"')]
    missing += [name for name in STORE_COUNTERS if not has_metric(text, f"quillcache_store_{name}_total")]
    assert not missing, f"store counters missing from /metrics: {missing}"
    assert "lease_waits" in TIER_COUNTERS


# --------------------------------------------------------------------------- durability (SSD tier)


def test_durable_put_reads_back_after_a_clean_restart(tmp_path):
    d = Daemon(tmp_path, ssd=True).start()
    try:
        with Client(d.addr) as c:
            c.put(key(1), content(1, 100_000), durable=True)
            c.put(key(2), content(2, 5000))          # write_back: DRAM only, lost at restart
            info = c.info()
            assert info["WAL"]["backend"] in ("io_uring", "uring", "pwritev")
        assert d.stop() == 0
        d.start()
        with Client(d.addr) as c:
            assert c.get(key(1)) == content(1, 100_000)
    finally:
        d.stop()


def test_persistent_index_lists_the_ssd_blocks_after_a_restart_and_reports_the_check(tmp_path):
    d = Daemon(tmp_path, ssd=True, sections={"index": "persistent = true"}).start()
    try:
        with Client(d.addr) as c:
            for i in range(1, 6):
                c.put(key(i), content(i, 3000), durable=True)
            c.put(key(9), content(9, 3000))           # write_back: DRAM only, gone at restart
            assert [k.block_hash for k in c.ls(key(1).scope)] == ["b1", "b2", "b3", "b4", "b5", "b9"]
        assert d.stop() == 0
        assert [p.parent.name for p in tmp_path.rglob("checkpoint.qck")] == ["index"]   # written at stop
        d.start()
        with Client(d.addr) as c:
            assert [k.block_hash for k in c.ls(key(1).scope)] == ["b1", "b2", "b3", "b4", "b5"]
            store = c.info("Store")["Store"]
            assert int(store["index_agreed_at_start"]) == 5
            assert int(store["index_added_at_start"]) == 0 and int(store["index_dropped_at_start"]) == 0
            assert c.get(key(3)) == content(3, 3000)
        assert "residency index" in d.log() and "5 agreed" in d.log()
    finally:
        d.stop()


KILL9_SSD_CAPACITY = 256 << 20      # bytes
KILL9_WRITERS = 4
# Each writer stops at this many bytes, so the SSD tier can never fill up and evict: an
# acknowledged put missing after the restart is then a loss, never a cache eviction.  At
# ~40 MB/s here the writers are still busy at the kill (1.5 s); padding to 4 KiB units
# adds at most 4 KiB a put (a few MiB in all), well inside the margin.
KILL9_WRITER_BYTES = KILL9_SSD_CAPACITY * 3 // 4 // KILL9_WRITERS


def _durable_writer(addr: str, start: int, stop: threading.Event, acked: list, errors: list) -> None:
    i = start
    written = 0
    try:
        with Client(addr, timeout=10) as c:
            while not stop.is_set():
                size = 1 + (i * 7919) % 60_000
                if written + size > KILL9_WRITER_BYTES:
                    return
                c.put(key(i), content(i, size), durable=True)
                acked.append((i, size))
                written += size
                i += 1
    except Exception as exc:            # the kill -9 ends every writer with ConnectionLost
        errors.append(exc)


def test_kill_9_under_write_through_load_loses_no_acknowledged_put(tmp_path):
    d = Daemon(tmp_path, ssd=True, sections={"store": 'policy = "write_through"'},
               ssd_capacity=f"{KILL9_SSD_CAPACITY >> 20}MiB").start()
    acked: list = []
    errors: list = []
    stop = threading.Event()
    writers = [threading.Thread(target=_durable_writer, args=(d.addr, n * 1_000_000, stop, acked, errors))
               for n in range(KILL9_WRITERS)]
    for t in writers:
        t.start()
    time.sleep(1.5)
    d.proc.kill()
    d.wait(10)
    stop.set()
    for t in writers:
        t.join(15)
    assert len(acked) > 20, f"too few puts acknowledged before the kill ({len(acked)})"
    d.start()
    try:
        with Client(d.addr) as c:
            for start in range(0, len(acked), 256):
                chunk = acked[start:start + 256]
                got = c.get_many([key(i) for i, _ in chunk])
                for (i, size), data in zip(chunk, got):
                    assert data == content(i, size), f"acknowledged durable put {i} lost or wrong"
    finally:
        d.stop()


def test_the_unix_socket_listens_before_the_tcp_port_opens(tmp_path):
    # A client that finds the TCP port open (a probe, quillctl, the harness) must find the Unix
    # socket too: it was bound and listening first. Started three times to catch the ordering.
    for _ in range(3):
        d = Daemon(tmp_path).start(wait=False)
        try:
            deadline = time.monotonic() + 30
            while True:
                assert d.proc.poll() is None, d.log()
                try:
                    socket.create_connection(("127.0.0.1", d.port), timeout=0.2).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, d.log()
                    time.sleep(0.005)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
                u.connect(str(d.data_dir / "quillcached.sock"))
        finally:
            d.stop()
