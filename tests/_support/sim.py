"""quillcache-sim-engine as a real subprocess for tests: free loopback ports (the engine binds
port 0 and ``tcp://127.0.0.1:*`` and reports what it got on its READY line), HTTP helpers,
start and stop with signals.

    with SimEngine(block_size=4, capacity_blocks=64) as eng:
        reply = eng.post("/v1/completions", {"prompt": "hello", "max_tokens": 3})
        eng.events, eng.replay          # the ZMQ PUB and replay endpoints
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

SIM_ENGINE = str(Path(sys.executable).with_name("quillcache-sim-engine"))
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 30.0


class SimEngine:
    """One simulated engine process.  Keyword arguments become flags (``block_size=4`` ->
    ``--block-size 4``; ``adapters=["a"]`` -> ``--adapter a``).  ``events=False`` turns the
    KV-event publisher off.  ``time_scale`` defaults to 0.001 (the modelled H200 runs a
    thousand times faster than life, so tests take milliseconds)."""

    def __init__(self, *, events: bool = True, time_scale: float = 0.001, **flags) -> None:
        self.args = [SIM_ENGINE, "--host", "127.0.0.1", "--port", "0",
                     "--time-scale", repr(time_scale)]
        if events:
            self.args += ["--kv-events", "tcp://127.0.0.1:*",
                          "--kv-events-replay", "tcp://127.0.0.1:*"]
        for name, value in flags.items():
            if name == "adapters":
                for a in value:
                    self.args += ["--adapter", a]
                continue
            self.args += ["--" + name.replace("_", "-"), str(value)]
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self.events: Optional[str] = None
        self.replay: Optional[str] = None

    def start(self) -> "SimEngine":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        line = self._read_line(START_TIMEOUT_S)
        if not line.startswith("READY "):
            err = self.stop()
            raise RuntimeError(f"quillcache-sim-engine did not start: {line!r} {err}")
        fields = dict(part.split("=", 1) for part in line.split()[1:])
        self.url = fields["http"]
        self.events = None if fields["events"] == "-" else fields["events"]
        self.replay = None if fields["replay"] == "-" else fields["replay"]
        return self

    def _read_line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return buf.decode(errors="replace") + " (timed out)"
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                buf += chunk
        finally:
            sel.close()
        return buf.split(b"\n", 1)[0].decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Stop it; returns its stderr.  Raises if it does not exit in time."""
        p = self.proc
        if p is None:
            return ""
        self.proc = None
        if p.poll() is None:
            p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise RuntimeError("quillcache-sim-engine did not exit on SIGTERM") from None
        return err.decode(errors="replace")

    def __enter__(self) -> "SimEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP

    def request(self, method: str, path: str, body: Optional[dict] = None,
                headers: Optional[dict] = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: dict, headers: Optional[dict] = None) -> dict:
        status, raw = self.request("POST", path, body, headers)
        if status != 200:
            raise AssertionError(f"POST {path}: HTTP {status}: {raw[:500]!r}")
        return json.loads(raw)

    def get(self, path: str) -> dict:
        status, raw = self.request("GET", path)
        if status != 200:
            raise AssertionError(f"GET {path}: HTTP {status}: {raw[:500]!r}")
        return json.loads(raw) if raw else {}

    def stats(self) -> dict:
        return self.get("/sim/stats")


def synthetic_trace(conversations: int = 24, turns: int = 4, seed: int = 1, block_tokens: int = 512) -> list[str]:
    """Mooncake-format JSON lines: conversations under one shared system block (id 0), each
    turn extending the previous prompt by two blocks; arrivals interleave the conversations
    (about one a minute of trace time)."""
    import random
    rng = random.Random(seed)
    next_id = 1
    lines = []
    t = 0.0
    histories = [[0] for _ in range(conversations)]
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    for c in order:
        h = histories[c]
        h += [next_id, next_id + 1]
        next_id += 2
        n_in = len(h) * block_tokens - rng.randrange(0, block_tokens)
        lines.append(json.dumps({"timestamp": int(t), "input_length": n_in,
                                 "output_length": rng.randrange(20, 120), "hash_ids": list(h)}))
        t += rng.expovariate(1 / 60.0)
    return lines
