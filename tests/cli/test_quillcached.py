"""quillcached's own front end: a build without its native extensions refuses to start."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from quillcache import exitcodes
from quillcache._native import extension_names, missing_extensions

# Runs quillcached's main() in a fresh interpreter where one extension cannot be imported,
# as when its .so is missing or was built for another Python.
_BROKEN = textwrap.dedent("""
    import sys
    class NoSo:
        def find_spec(self, name, path=None, target=None):
            if name == "quillcache._native.alloc":
                raise ImportError("libquill: cannot open shared object file (simulated)")
            return None
    sys.meta_path.insert(0, NoSo())
    from quillcache_cli.quillcached import main
    main(["--config", sys.argv[1]])
""")


def test_this_build_has_every_native_extension():
    names = extension_names()
    assert {"quillcache._native.codec", "quillcache._native.alloc", "quillcache._native.wal"} <= set(names)
    assert missing_extensions() == []


def test_a_build_without_a_native_extension_exits_69_naming_it(tmp_path):
    conf = tmp_path / "quillcache.toml"
    conf.write_text(f'[node]\nlisten = "127.0.0.1:0"\ndata_dir = "{tmp_path / "data"}"\n')
    r = subprocess.run([sys.executable, "-c", _BROKEN, str(conf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == exitcodes.UNAVAILABLE == 69
    assert "native extension quillcache._native.alloc does not load" in r.stderr
    assert "simulated" in r.stderr and "make build" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()          # refused before touching anything


def test_ctrl_c_on_make_run_stops_the_node_with_exit_0_and_removes_its_socket(tmp_path):
    """`make run` is quillcached in the foreground: Ctrl-C (SIGINT to the terminal's group)
    drains and stops it with exit 0, and --unix-socket (the systemd unit's flag) is where it listened."""
    import os
    import signal
    import socket
    import time

    from tests._support.daemon import Daemon

    d = Daemon(tmp_path)
    sock = tmp_path / "run" / "q.sock"
    sock.parent.mkdir()
    argv = [str(Path(sys.executable).with_name("quillcached")), "--config", str(d.config), "--unix-socket", str(sock)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
        assert oct(sock.stat().st_mode & 0o777) == "0o660"
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=30)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "stopped" in out and not sock.exists()
