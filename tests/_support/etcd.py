"""A real etcd server (Debian ``etcd-server``) on free loopback ports, for the cluster
tests, ``make cluster`` and bench/cluster.py.  ``restart`` keeps its data dir and ports.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests._support.net import free_port

__all__ = ["EtcdServer", "etcd_binary", "free_port"]

START_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    return shutil.which("etcd") or (os.path.exists("/usr/bin/etcd") and "/usr/bin/etcd") or None


class EtcdServer:
    def __init__(self, data_dir: Path | None = None, *, host: str = "127.0.0.1", port: int | None = None,
                 netns: str | None = None) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian package etcd-server; `make deps` installs it)")
        self.binary = binary
        self.host = host
        # inside a fresh namespace every port is free: 2379/2380 as etcd's defaults
        self.port = port or (2379 if netns else free_port(host))
        self.peer_port = 2380 if netns else free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="qc-etcd-"))
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.netns = netns          # run inside this network namespace (ip netns exec)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_suffix(".log")

    def start(self) -> "EtcdServer":
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        self._log = open(self.log_path, "ab")
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.proc = subprocess.Popen(prefix + [
            self.binary, "--name", "qc", "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"qc={peer}", "--initial-cluster-state", "new",
            "--log-level", "warn", "--logger", "zap"],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            self.stop(signal.SIGKILL)       # not left running: __exit__ does not run when __enter__ raises
            raise
        return self

    def wait_ready(self) -> None:
        if self.netns:                  # probe from inside its namespace
            code = (f"import json,time,urllib.request\nt=time.monotonic()+{START_TIMEOUT_S}\n"
                    "while time.monotonic()<t:\n try:\n"
                    f"  r=urllib.request.urlopen('http://{self.endpoint}/health',timeout=0.5)\n"
                    "  if json.loads(r.read()).get('health')=='true': raise SystemExit(0)\n"
                    " except OSError: pass\n time.sleep(0.05)\nraise SystemExit(1)")
            r = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c", code])
            if r.returncode != 0:
                raise RuntimeError(f"etcd did not become healthy in {self.netns}: {self.log()}")
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy within {START_TIMEOUT_S} s: {self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop(signal.SIGKILL)
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                self.log_path.unlink()
            except OSError:
                pass

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
