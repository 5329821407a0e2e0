"""A real quillcache-gateway process in front of real quillcache-sim-engine processes, on free
loopback ports, for the tests that probe the gateway from outside (tests/security).

    with GatewayProcess(tmp_path, engines=1) as gp:
        status, headers, body = gp.post("/v1/completions", {...}, tenant="alice")
"""
from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from quillcache.settings.convert import hash_token
from tests._support.net import free_port

__all__ = ["GatewayProcess", "TENANT_KEYS", "GATEWAY", "SIM_ENGINE", "decision"]

GATEWAY = str(Path(sys.executable).with_name("quillcache-gateway"))
SIM_ENGINE = str(Path(sys.executable).with_name("quillcache-sim-engine"))
TENANT_KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789", "carol": "key-carol-0123456789"}
START_TIMEOUT_S = 30.0


def decision(headers) -> dict:
    """The x-quillcache-* headers, without their prefix."""
    return {k.lower()[len("x-quillcache-"):]: v for k, v in headers.items()
            if k.lower().startswith("x-quillcache-")}


def _known(keys: str) -> str:
    """The [gateway] key lines this gateway knows: the probes also run against a gateway from
    before a setting existed (where they must fail by what they probe, not by a config error)."""
    from quillcache.gateway.settings import GATEWAY_REGISTRY
    known = set(GATEWAY_REGISTRY.by_section["gateway"])
    return "".join(line + "\n" for line in keys.splitlines() if line.split("=", 1)[0].strip() in known)


class GatewayProcess:
    """``engines`` simulated engines (model "m", KV events on) behind one gateway process
    with the tenants of ``TENANT_KEYS``; ``gateway_toml`` adds [gateway] keys, ``router_toml``
    [router] keys; ``nofile`` sets the gateway's descriptor limit (soft and hard); ``engine_args``
    are more quillcache-sim-engine options; ``extra_toml`` more sections (``[cluster]``)."""

    def __init__(self, tmp_path: Path, *, engines: int = 1, gateway_toml: str = "", router_toml: str = "",
                 nofile: Optional[int] = None, time_scale: float = 1.0, engine_args: tuple = (),
                 extra_toml: str = "") -> None:
        self.tmp = Path(tmp_path)
        self.n_engines = engines
        self.gateway_toml = gateway_toml
        self.router_toml = router_toml
        self.nofile = nofile
        self.time_scale = time_scale
        self.engine_args = tuple(engine_args)
        self.extra_toml = extra_toml
        self.port, self.admin_port = free_port(), free_port()
        self.config = self.tmp / "gateway.toml"
        self.log_path = self.tmp / "gateway.log"
        self.engine_urls: list[str] = []
        self._engines: list[subprocess.Popen] = []
        self.proc: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ lifecycle

    def _start_engine(self, i: int) -> str:
        ev, rp = free_port(), free_port()
        p = subprocess.Popen([SIM_ENGINE, "--port", "0", "--model", "m", "--time-scale", repr(self.time_scale),
                              "--kv-events", f"tcp://127.0.0.1:{ev}", "--kv-events-replay", f"tcp://127.0.0.1:{rp}",
                              *self.engine_args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._engines.append(p)
        line = p.stdout.readline().decode()
        if not line.startswith("READY"):
            raise RuntimeError(f"engine {i} did not start: {line!r}")
        fields = dict(part.split("=", 1) for part in line.split()[1:])
        self.engine_urls.append(fields["http"])
        return (f'[[gateway.engines]]\nid = "e{i}"\nurl = "{fields["http"]}"\nmodel = "m"\n'
                f'kv_events = "{fields["events"]}"\nkv_replay = "{fields["replay"]}"\n')

    def write_config(self, gateway_toml: Optional[str] = None) -> None:
        if gateway_toml is not None:
            self.gateway_toml = gateway_toml
        tenants = "".join(f'[[auth.tenants]]\nname = "{n}"\ntoken = "{hash_token(k)}"\n'
                          for n, k in TENANT_KEYS.items())
        router = f"[router]\n{self.router_toml}\n" if self.router_toml else ""
        keys = f'listen = "127.0.0.1:{self.port}"\nadmin_listen = "127.0.0.1:{self.admin_port}"\n{self.gateway_toml}'
        self.config.write_text("[gateway]\n" + _known(keys) + "\n" + router + tenants + self._engine_tables
                               + self.extra_toml)

    def start(self, *, signal_on_listen: Optional[int] = None) -> "GatewayProcess":
        """``signal_on_listen``: send that signal the moment the port accepts a connection
        (while the gateway may still be starting), then wait for /health as usual."""
        self._engine_tables = "".join(self._start_engine(i) for i in range(self.n_engines))
        self.write_config()
        nofile = self.nofile

        def limits() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([GATEWAY, "--config", str(self.config)], stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=limits)
        deadline = time.monotonic() + START_TIMEOUT_S
        while signal_on_listen is not None and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.05).close()
            except OSError:
                time.sleep(0.001)
                continue
            self.proc.send_signal(signal_on_listen)
            break
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quillcache-gateway exited {self.proc.returncode}: {self.log()}")
            try:
                if self.get("/health")[0] == 200:
                    time.sleep(0.5)               # ZMQ slow joiner: the event subscriptions connect
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"quillcache-gateway did not answer /health: {self.log()}")

    def stop(self) -> int:
        rc = 0
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        elif self.proc is not None:
            rc = self.proc.returncode
        for p in self._engines:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
        return rc

    def __enter__(self) -> "GatewayProcess":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ requests

    def request(self, method: str, path: str, body: Optional[dict] = None, tenant: Optional[str] = None,
                admin: bool = False, timeout: float = 30.0, source: str = "127.0.0.1") -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port if admin else self.port, timeout=timeout,
                                          source_address=(source, 0))
        try:
            headers = {"Content-Type": "application/json"}
            if tenant is not None:
                headers["Authorization"] = f"Bearer {TENANT_KEYS[tenant]}"
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def get(self, path: str, admin: bool = False) -> tuple[int, dict, bytes]:
        return self.request("GET", path, admin=admin)

    def complete(self, prompt: str, tenant: str = "alice", source: str = "127.0.0.1",
                 **extra) -> tuple[int, dict, bytes]:
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": False, **extra}
        return self.request("POST", "/v1/completions", body, tenant, source=source)

    def engine_stats(self, i: int = 0) -> dict:
        host, port = self.engine_urls[i].split("//", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/sim/stats")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()
