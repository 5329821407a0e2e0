"""`make gateway`: one QuillCache node, two simulated engines and a gateway, on loopback.

Every process runs on its embedded defaults except what conf/gateway.toml says (the engines'
addresses).  Ctrl-C stops them all.  Not a production launcher: systemd runs each for real.
"""
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENGINES = (("sim-0", 8001, 5571, 5572), ("sim-1", 8002, 5573, 5574))
READY_TIMEOUT_S = 30.0        # seconds each process has to come up


def _wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"make gateway: {what} exited with code {proc.returncode} (see its log above)")
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    sys.exit(f"make gateway: {what} did not answer {url} within {READY_TIMEOUT_S:.0f}s")


def main() -> int:
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(what: str, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, cwd=ROOT)
        procs.append((what, p))
        return p

    try:
        node = start("quillcached", [str(BIN / "quillcached"), "--data-dir", "var/gateway-demo"])
        _wait_http("http://127.0.0.1:7471/metrics", node, "quillcached")
        for eid, port, ev, rp in ENGINES:
            p = start(eid, [str(BIN / "quillcache-sim-engine"), "--port", str(port), "--model", "sim-model",
                            "--adapter", "sim-lora", "--kv-events", f"tcp://127.0.0.1:{ev}",
                            "--kv-events-replay", f"tcp://127.0.0.1:{rp}"])
            _wait_http(f"http://127.0.0.1:{port}/health", p, eid)
        gw = start("quillcache-gateway", [str(BIN / "quillcache-gateway"), "--config", "conf/gateway.toml"])
        _wait_http("http://127.0.0.1:8088/health", gw, "quillcache-gateway")
        print("\nquillcache-gateway is ready on http://127.0.0.1:8088 (two simulated engines, one node). Try:\n\n"
              "  curl -sN http://127.0.0.1:8088/v1/completions -H 'Content-Type: application/json' \\\n"
              "    -d '{\"model\": \"sim-model\", \"prompt\": \"Hello from QuillCache\", \"max_tokens\": 8, "
              "\"stream\": true}' -D -\n\n"
              "  .venv/bin/quillctl gateway          # workers, load, hit rates\n\n"
              "Ctrl-C stops everything.\n", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:                                   # until Ctrl-C, or one of them stops
            for what, p in procs:
                if p.poll() is not None:
                    print(f"make gateway: {what} exited with code {p.returncode}; stopping the rest")
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        for _, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
