"""quillcached as a real subprocess for tests: free loopback ports, its own TOML config and data
dir under the test's tmp_path, start/stop with signals and exit codes.

    with Daemon(tmp_path, ssd=True) as d:
        with Client(d.addr) as c: ...
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests._support import ucxshm
from tests._support.net import free_port

QUILLCACHED = str(Path(sys.executable).with_name("quillcached"))
START_TIMEOUT_S = 30.0


def base_toml(port: int, metrics_port: int, data_dir: Path, *, ssd: bool = False, dram: str = "64MiB",
              max_block: str = "8MiB", ssd_capacity: str = "64MiB", direct_io: bool = False,
              extra: str = "") -> str:
    text = f"""
[node]
listen = "127.0.0.1:{port}"
data_dir = "{data_dir}"
log_level = "info"
drain_timeout = "5s"

[store]
dram = "{dram}"
max_block = "{max_block}"

[ssd]
enabled = {"true" if ssd else "false"}
capacity = "{ssd_capacity}"
direct_io = {"true" if direct_io else "false"}

[metrics]
listen = "127.0.0.1:{metrics_port}"
"""
    return text + extra


def merge_toml(base: str, extra_sections: dict[str, str]) -> str:
    """Append lines to sections of ``base`` (a tiny helper to keep TOML tables unique)."""
    out = []
    for line in base.splitlines():
        out.append(line)
        stripped = line.strip()
        if stripped.startswith("[") and stripped.strip("[]") in extra_sections:
            out.append(extra_sections.pop(stripped.strip("[]")))
    for section, body in extra_sections.items():
        out += [f"[{section}]", body]
    return "\n".join(out) + "\n"


class Daemon:
    """A quillcached subprocess on free loopback ports with its data dir under tmp_path."""

    def __init__(self, tmp_path: Path, *, ssd: bool = False, sections: dict[str, str] | None = None,
                 dram: str = "64MiB", max_block: str = "8MiB", env: dict | None = None,
                 data_dir: Path | None = None, port: int | None = None, ssd_capacity: str = "64MiB",
                 direct_io: bool = False) -> None:
        self.tmp = Path(tmp_path)
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.data_dir = data_dir or self.tmp / "data"
        self.config = self.tmp / f"quillcache-{self.port}.toml"
        self.log_path = self.tmp / f"quillcached-{self.port}.log"
        self.ssd_capacity = ssd_capacity
        self.direct_io = direct_io
        self.write_config(ssd=ssd, sections=sections, dram=dram, max_block=max_block)
        self.env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None
        self._killed_shm: set[str] = set()   # UCX segments of a process killed here (``ucxshm``)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def write_config(self, *, ssd: bool = False, sections: dict[str, str] | None = None,
                     dram: str = "64MiB", max_block: str = "8MiB") -> None:
        text = base_toml(self.port, self.metrics_port, self.data_dir, ssd=ssd, dram=dram, max_block=max_block,
                         ssd_capacity=self.ssd_capacity, direct_io=self.direct_io)
        self.config.write_text(merge_toml(text, dict(sections or {})))

    def start(self, wait: bool = True) -> "Daemon":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("this Daemon is already running (a second start would leak it)")
        self._reap()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([QUILLCACHED, "--config", str(self.config)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quillcached exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"quillcached did not listen within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def send(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self._killed_shm |= ucxshm.segments(self.proc.pid)
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.returncode is not None:
                self._log.close()
                self._reap()

    def _reap(self) -> None:
        # a process killed with SIGKILL never unlinks its UCX segments (a NIXL agent's)
        if self._killed_shm:
            ucxshm.reap(self._killed_shm)
            self._killed_shm = set()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self._reap()
            return self.proc.returncode if self.proc else 0
        self.send(sig)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.wait(5)
            raise

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGKILL if exc[0] is not None else signal.SIGTERM)
