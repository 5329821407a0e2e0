"""`make gateway`: one QuillCache node, two simulated engines and a gateway, on loopback.

Every process runs on its embedded defaults except what conf/gateway.toml says (the engines'
addresses).  Ctrl-C stops them all.  Not a production launcher: systemd runs each for real.

``--port-offset N`` moves every port by N (the gateway on 8088 + N, ...), so that a test can
run the demo beside whatever already listens on the default ports.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENGINES = (("sim-0", 8001, 5571, 5572), ("sim-1", 8002, 5573, 5574))
GATEWAY_PORT = 8088
NODE_PORT, NODE_METRICS_PORT = 7470, 7471      # quillcached's embedded defaults
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


def main(offset: int = 0) -> int:
    procs: list[tuple[str, subprocess.Popen]] = []
    data = Path("var") / ("gateway-demo" if not offset else f"gateway-demo-{offset}")

    def start(what: str, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, cwd=ROOT)
        procs.append((what, p))
        return p

    def port(p: int) -> int:
        return p + offset

    node_argv = [str(BIN / "quillcached"), "--data-dir", str(data)]
    gateway_config = "conf/gateway.toml"
    if offset:
        (ROOT / data).mkdir(parents=True, exist_ok=True)
        node_conf = ROOT / data / "node.toml"
        node_conf.write_text(f'[metrics]\nlisten = "127.0.0.1:{port(NODE_METRICS_PORT)}"\n')
        node_argv += ["--config", str(node_conf), "--listen", f"127.0.0.1:{port(NODE_PORT)}"]
        text = (ROOT / gateway_config).read_text()
        text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{port(int(m.group(1)))}", text)
        gateway_config = str(data / "gateway.toml")
        (ROOT / gateway_config).write_text(text)
    base = f"http://127.0.0.1:{port(GATEWAY_PORT)}"
    try:
        node = start("quillcached", node_argv)
        _wait_http(f"http://127.0.0.1:{port(NODE_METRICS_PORT)}/metrics", node, "quillcached")
        for eid, http, ev, rp in ENGINES:
            p = start(eid, [str(BIN / "quillcache-sim-engine"), "--port", str(port(http)), "--model", "sim-model",
                            "--adapter", "sim-lora", "--kv-events", f"tcp://127.0.0.1:{port(ev)}",
                            "--kv-events-replay", f"tcp://127.0.0.1:{port(rp)}"])
            _wait_http(f"http://127.0.0.1:{port(http)}/health", p, eid)
        gw = start("quillcache-gateway", [str(BIN / "quillcache-gateway"), "--config", gateway_config])
        _wait_http(base + "/health", gw, "quillcache-gateway")
        print(f"\nquillcache-gateway is ready on {base} (two simulated engines, one node). Try:\n\n"
              f"  curl -sN {base}/v1/completions -H 'Content-Type: application/json' \\\n"
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
    ap = argparse.ArgumentParser(description="make gateway: a node, two simulated engines, a gateway")
    ap.add_argument("--port-offset", type=int, default=0, help="move every port by this much")
    sys.exit(main(ap.parse_args().port_offset))
