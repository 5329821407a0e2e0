"""A DRAM-only quillcached started by a benchmark: TCP on a free loopback port and the Unix
socket in a temporary data dir; stopped (and the dir removed) on exit.

Runs the daemon as ``python -c "...quillcached main"`` with this interpreter, so it works
from an editable install and from a ``pip install --target DIR`` tree on PYTHONPATH alike.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._support.ports
from tests._support.ports import free_port

START_TIMEOUT_S = 60.0          # seconds: prefaulting a large arena takes a while
_RUN = "import sys; from quillcache_cli.quillcached import main; sys.exit(main())"


class LocalNode:
    """``with LocalNode(dram="3GiB") as node: Client(node.tcp) / Client(node.unix)``."""

    def __init__(self, *, dram: str = "1GiB", max_block: str = "64MiB", hugepages: bool = True,
                 prefault: bool = False, lease: str = "30s") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qc-bench-"))
        self.port = free_port()
        self.sock = self.dir / "quillcached.sock"
        self.config = self.dir / "quillcache.toml"
        self.config.write_text(f"""
[node]
listen = "127.0.0.1:{self.port}"
data_dir = "{self.dir}"
log_level = "warning"
[store]
dram = "{dram}"
max_block = "{max_block}"
hugepages = {"true" if hugepages else "false"}
prefault = {"true" if prefault else "false"}
lease = "{lease}"
[ssd]
enabled = false
[metrics]
enabled = false
""")
        self.proc = None

    @property
    def tcp(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def unix(self) -> str:
        return f"unix:{self.sock}"

    def __enter__(self) -> "LocalNode":
        self.log = open(self.dir / "quillcached.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", _RUN, "--config", str(self.config)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quillcached exited {self.proc.returncode}: "
                                   f"{(self.dir / 'quillcached.log').read_text(errors='replace')}")
            if self.sock.exists():
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                        return self
                except OSError:
                    pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"quillcached did not start within {START_TIMEOUT_S} s")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
