"""conf/: the systemd unit, the node's defaults and the docs name one Unix socket for engines,
in one runtime directory, with the same modes and group."""
from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

from quillcache.net import DEFAULT_UNIX_SOCKET
from quillcache.node.daemon import UNIX_SOCKET_MODE
from quillcache_cli.quillcached import main as quillcached_main

ROOT = Path(__file__).resolve().parents[1]


def unit() -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#",))
    cp.optionxform = str
    cp.read_string((ROOT / "conf" / "quillcached.service").read_text())
    return cp["Service"]


def test_the_unit_puts_the_socket_in_its_runtime_directory_with_group_access():
    svc = unit()
    argv = shlex.split(svc["ExecStart"])
    sock = argv[argv.index("--unix-socket") + 1]
    assert sock == DEFAULT_UNIX_SOCKET == "/run/quillcache/quillcached.sock"
    assert Path(sock).parent == Path("/run") / svc["RuntimeDirectory"]
    assert svc["RuntimeDirectoryMode"] == "0750"                      # the group may enter
    assert svc["User"] == svc["Group"] == "quillcache"
    assert UNIX_SOCKET_MODE == 0o660                                  # the group may connect
    assert any(p.name == "unix_socket" for p in quillcached_main.params)   # the flag ExecStart uses


def test_the_docs_name_the_units_socket_modes_and_group():
    svc = unit()
    sock = shlex.split(svc["ExecStart"])[shlex.split(svc["ExecStart"]).index("--unix-socket") + 1]
    shm = (ROOT / "docs" / "shm.md").read_text()
    engines = (ROOT / "docs" / "engines.md").read_text()
    for doc in (shm, engines):
        assert f"`{sock}`" in doc
        assert "`0750`" in doc and "`0660`" in doc
        assert "usermod -aG quillcache ENGINE_USER" in doc
    assert f"RuntimeDirectoryMode={svc['RuntimeDirectoryMode']}" in shm
    assert f"RuntimeDirectory={svc['RuntimeDirectory']}" in shm
    # every socket path the engine docs give a connector is the unit's
    for path in set(re.findall(r"unix:(/[\w/.-]+\.sock)", engines)):
        assert path == sock, path
    unit_text = (ROOT / "conf" / "quillcached.service").read_text()
    assert "usermod -aG quillcache ENGINE_USER" in unit_text
