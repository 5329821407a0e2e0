"""`make gateway`: one QuillCache node, two simulated engines and a gateway, on loopback.

Every process runs on its embedded defaults except what conf/gateway.toml says (the engines'
addresses); the engines use the node as their KV pool (``quillcache-sim-engine --pool``, over
the node's Unix socket).  Ctrl-C (or SIGTERM) stops them all and exits 0; a process that ends on
its own is reported and the others keep running.  Not a production launcher: systemd runs each
for real.

``--port-offset N`` moves every port by N (the gateway on 8088 + N, ...), so that a test can
run the demo beside whatever already listens on the default ports.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENGINES = (("sim-0", 8001, 5571, 5572), ("sim-1", 8002, 5573, 5574))
GATEWAY_PORT, ADMIN_PORT = 8088, 8089          # conf/gateway.toml's listen and admin_listen
# not quillcached's defaults (7470, 7471): `make run` in another shell keeps serving beside the demo
NODE_PORT, NODE_METRICS_PORT = 7480, 7481
READY_TIMEOUT_S = 30.0        # seconds each process has to come up
# a prompt of several full blocks (the simulated tokenizer: one token per UTF-8 byte, 16 a block)
POOL_BODY = ('{"model": "sim-model", "prompt": "The pool keeps what one engine computed, for the other one.", '
             '"max_tokens": 1}')


class _Stopped(Exception):
    """Ctrl-C while the processes were starting."""


def _wait_http(url: str, proc: subprocess.Popen, what: str, stop: list) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if stop:
            raise _Stopped()
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
    stop: list[int] = []

    def on_signal(signum, _frame) -> None:
        stop.append(signum)

    def start(what: str, argv: list[str]) -> subprocess.Popen:
        # its own process group: Ctrl-C reaches this script only, which stops the others in
        # order (gateway, engines, node) and exits 0
        p = subprocess.Popen(argv, cwd=ROOT, process_group=0)
        procs.append((what, p))
        return p

    def port(p: int) -> int:
        return p + offset

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    (ROOT / data).mkdir(parents=True, exist_ok=True)
    node_argv = [str(BIN / "quillcached"), "--data-dir", str(data)]
    node_unix = f"unix:{ROOT / data / 'quillcached.sock'}"
    gateway_config = "conf/gateway.toml"
    node_conf = ROOT / data / "node.toml"
    node_conf.write_text(f'[metrics]\nlisten = "127.0.0.1:{port(NODE_METRICS_PORT)}"\n')
    node_argv += ["--config", str(node_conf), "--listen", f"127.0.0.1:{port(NODE_PORT)}"]
    if offset:
        text = (ROOT / gateway_config).read_text()
        text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{port(int(m.group(1)))}", text)
        gateway_config = str(data / "gateway.toml")
        (ROOT / gateway_config).write_text(text)
    base = f"http://127.0.0.1:{port(GATEWAY_PORT)}"
    try:
        node = start("quillcached", node_argv)
        _wait_http(f"http://127.0.0.1:{port(NODE_METRICS_PORT)}/ready", node, "quillcached", stop)
        for eid, http, ev, rp in ENGINES:
            p = start(eid, [str(BIN / "quillcache-sim-engine"), "--port", str(port(http)), "--model", "sim-model",
                            "--adapter", "sim-lora", "--kv-events", f"tcp://127.0.0.1:{port(ev)}",
                            "--kv-events-replay", f"tcp://127.0.0.1:{port(rp)}", "--pool", node_unix])
            _wait_http(f"http://127.0.0.1:{port(http)}/health", p, eid, stop)
        gw = start("quillcache-gateway", [str(BIN / "quillcache-gateway"), "--config", gateway_config])
        _wait_http(base + "/health", gw, "quillcache-gateway", stop)
        e0, e1 = (f"http://127.0.0.1:{port(e[1])}" for e in ENGINES)
        print(f"\nquillcache-gateway is ready on {base} (two simulated engines sharing one node as "
              f"their KV pool, {node_unix}). Try:\n\n"
              f"  curl -sN {base}/v1/completions -H 'Content-Type: application/json' \\\n"
              "    -d '{\"model\": \"sim-model\", \"prompt\": \"Hello from QuillCache\", \"max_tokens\": 8, "
              "\"stream\": true}' -D -\n\n"
              f"  .venv/bin/quillctl gateway --addr 127.0.0.1:{port(ADMIN_PORT)}     # workers, load, hit rates\n\n"
              "The pool: the same prompt to one engine, then to the other; the second answer's\n"
              "usage.prompt_tokens_details.pool_tokens is above 0 (loaded from the node, not computed):\n\n"
              f"  curl -s {e0}/v1/completions -H 'Content-Type: application/json' -d '{POOL_BODY}'\n"
              f"  curl -s {e1}/v1/completions -H 'Content-Type: application/json' -d '{POOL_BODY}'\n\n"
              "Ctrl-C stops everything.\n", flush=True)
        reported: set[str] = set()
        while not stop:                               # until Ctrl-C; a process that ends is reported
            for what, p in procs:
                if what not in reported and p.poll() is not None:
                    reported.add(what)
                    print(f"make gateway: {what} (pid {p.pid}) exited with code {p.returncode}; the others "
                          "keep running (Ctrl-C stops them)", flush=True)
            time.sleep(0.5)
        return 0
    except _Stopped:
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
                p.wait()
        if offset:
            shutil.rmtree(ROOT / data, ignore_errors=True)
        print("make gateway: stopped", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ap = argparse.ArgumentParser(description="make gateway: a node, two simulated engines, a gateway")
    ap.add_argument("--port-offset", type=int, default=0, help="move every port by this much")
    sys.exit(main(ap.parse_args().port_offset))
