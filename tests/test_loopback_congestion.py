"""Same-host TCP connections: their congestion control ([node] loopback_congestion, the clients'
``quillcache.net.LOOPBACK_CONGESTION``), checked on real sockets and a real quillcached.

A pacing algorithm (bbr) on loopback holds a reply back to its model's rate; the node and the
clients set reno on a connection whose two ends are on this host and leave every other
connection to the system's choice.  What the kernel actually runs is read back with
``getsockopt`` on our own sockets and with ``ss`` on the daemon's.
"""
from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from quillcache import AsyncClient, Client
from quillcache.net import (LOOPBACK_CONGESTION, same_host, same_host_addresses, set_congestion, system_congestion,
                            tune_same_host)
from quillcache.node.settings import ConfigError, load_config
from tests._support.daemon import Daemon
from tests._support.data import key
from tests._support.net import raw_connect

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION on this OS")


def congestion(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()


def server_side_congestion(port: int, client: socket.socket) -> str | None:
    """What the daemon's end of ``client``'s connection runs, read with ``ss`` (None: no ss)."""
    if shutil.which("ss") is None:
        return None
    cport = client.getsockname()[1]
    out = subprocess.run(["ss", "-tniH", "state", "established", f"( sport = :{port} and dport = :{cport} )"],
                         capture_output=True, text=True, timeout=10).stdout
    names = re.findall(r"^\s+(\w+) ", out, re.M) or re.findall(r"\b(reno|cubic|bbr|bic|dctcp|htcp|vegas)\b", out)
    assert names, f"ss shows no connection {port} <- {cport}: {out!r}"
    return names[0]


def info_server(c: Client) -> dict:
    return c.info("Server")["Server"]


@pytest.mark.parametrize("peer,local,want", [
    ("127.0.0.1", "127.0.0.1", True),
    ("127.0.0.53", "127.0.0.1", True),              # all of 127/8 is this host
    ("::1", "::1", True),
    ("::ffff:127.0.0.1", "::ffff:127.0.0.1", True),  # an IPv4 client of a dual-stack listener
    ("10.1.2.3", "10.1.2.3", True),                  # a client of this host on one of its addresses
    ("::ffff:10.1.2.3", "10.1.2.3", True),
    ("10.1.2.4", "10.1.2.3", False),                 # another host
    ("fe80::1%eth0", "fe80::2%eth0", False),
    ("2001:db8::1", "2001:db8::2", False),
    ("not an address", "127.0.0.1", False),
])
def test_what_counts_as_the_same_host(peer, local, want):
    assert same_host_addresses(peer, local) is want


def _pair(host: str, listen: str):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ls = socket.socket(family, socket.SOCK_STREAM)
    ls.bind((listen, 0))
    ls.listen(1)
    c = socket.create_connection((host, ls.getsockname()[1]), timeout=5)
    s, _ = ls.accept()
    ls.close()
    return c, s


def _primary_address() -> str | None:
    """This host's address on its default route, if it has one that is not loopback."""
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        u.connect(("192.0.2.1", 9))                 # no packet leaves: it only picks a route
        addr = u.getsockname()[0]
    except OSError:
        return None
    finally:
        u.close()
    return None if addr.startswith("127.") else addr


def test_real_sockets_on_this_host_are_same_host_and_take_reno():
    pairs = [_pair("127.0.0.1", "127.0.0.1")]
    addr = _primary_address()
    if addr is not None:
        pairs.append(_pair(addr, "0.0.0.0"))        # not loopback, but both ends are this host
    try:
        for c, s in pairs:
            assert same_host(c) and same_host(s)
            assert tune_same_host(s) and congestion(s) == LOOPBACK_CONGESTION
    finally:
        for c, s in pairs:
            c.close()
            s.close()
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    assert not same_host(u) and not tune_same_host(u)   # not TCP: nothing to set
    u.close()


def test_a_name_the_kernel_refuses_leaves_the_socket_as_it_was():
    c, s = _pair("127.0.0.1", "127.0.0.1")
    try:
        before = congestion(s)
        assert not set_congestion(s, "nosuchcc")
        assert not set_congestion(s, "")
        assert congestion(s) == before
    finally:
        c.close()
        s.close()


@pytest.mark.parametrize("value,ok", [("reno", True), ("", True), ("cubic", True), ("BBR", False),
                                      ("reno; rm -rf", False), ("x" * 16, False)])
def test_the_setting_takes_a_congestion_name_or_nothing(tmp_path, value, ok):
    path = tmp_path / "quillcache.toml"
    path.write_text(f'[node]\nloopback_congestion = "{value}"\n')
    if ok:
        assert load_config(str(path)).node.loopback_congestion == value
    else:
        with pytest.raises(ConfigError, match="loopback_congestion.*not a TCP congestion control name"):
            load_config(str(path))


def test_node_and_client_set_reno_on_a_same_host_connection_and_not_on_the_unix_socket(tmp_path):
    with Daemon(tmp_path) as d, Client(d.addr) as c:
        assert congestion(c._sock) == LOOPBACK_CONGESTION          # the client's end (its PUTs)
        srv = info_server(c)
        assert srv["loopback_congestion"] == LOOPBACK_CONGESTION
        n = srv["loopback_congestion_set"]
        assert n >= 1                                              # this client's connection at least
        seen = server_side_congestion(d.port, c._sock)
        assert seen in (None, LOOPBACK_CONGESTION)                 # the node's end (its replies)
        # A peer that never logs in costs the same three syscalls and nothing more.
        raw = raw_connect(d.port)
        try:
            assert server_side_congestion(d.port, raw) in (None, LOOPBACK_CONGESTION)
            assert info_server(c)["loopback_congestion_set"] == n + 1
        finally:
            raw.close()
        with Client(f"unix:{d.data_dir}/quillcached.sock") as u:
            assert info_server(u)["loopback_congestion_set"] == n + 1


def test_the_async_client_sets_reno_on_its_end_too(tmp_path):
    async def main(addr):
        async with AsyncClient(addr) as c:
            sock = c._conn.transport.get_extra_info("socket")
            await c.put(key(7), b"x" * 1024)
            return congestion(sock), (await c.get(key(7)))

    with Daemon(tmp_path) as d:
        name, value = asyncio.run(main(d.addr))
    assert name == LOOPBACK_CONGESTION and value == b"x" * 1024


def test_an_empty_setting_leaves_same_host_connections_to_the_system(tmp_path):
    with Daemon(tmp_path, sections={"node": 'loopback_congestion = ""'}) as d, Client(d.addr) as c:
        srv = info_server(c)
        assert srv["loopback_congestion"] == "system" and srv["loopback_congestion_set"] == 0
        assert server_side_congestion(d.port, c._sock) in (None, system_congestion())


def test_a_name_the_kernel_lacks_is_logged_once_and_costs_nothing_else(tmp_path):
    with Daemon(tmp_path, sections={"node": 'loopback_congestion = "nosuchcc"'}) as d:
        for _ in range(3):
            with Client(d.addr) as c:
                assert c.ping() >= 0
                assert info_server(c)["loopback_congestion_set"] == 0
                assert server_side_congestion(d.port, c._sock) in (None, system_congestion())
        assert d.log().count("loopback_congestion = 'nosuchcc': the kernel refuses it") == 1


def test_sighup_applies_the_setting_to_connections_made_after_it(tmp_path):
    d = Daemon(tmp_path)
    with d, Client(d.addr) as c:
        n = info_server(c)["loopback_congestion_set"]
        d.write_config(sections={"node": 'loopback_congestion = ""'})
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while info_server(c)["loopback_congestion"] != "system" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert info_server(c)["loopback_congestion"] == "system"
        with Client(d.addr) as c2:
            assert server_side_congestion(d.port, c2._sock) in (None, system_congestion())
            assert info_server(c2)["loopback_congestion_set"] == n
        assert congestion(c._sock) == LOOPBACK_CONGESTION       # the client's own choice stays


def test_the_raw_socket_bench_measures_both_and_prints_their_ratio(capsys):
    from bench import loopback_congestion
    assert loopback_congestion.main(["--sizes", "64K,1M", "--rounds", "1", "--seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 64 KiB") or
            line.startswith("| 1 MiB")]
    assert len(rows) == 2
    for row in rows:
        system_mbs, reno_mbs = (float(x.replace(",", "")) for x in row[1:3])
        assert system_mbs > 0 and reno_mbs > 0
        assert abs(float(row[3].strip().rstrip("x")) - reno_mbs / system_mbs) < 0.01 + 0.01 * reno_mbs / system_mbs
    assert f"system congestion control: {system_congestion()}; compared: reno" in out
