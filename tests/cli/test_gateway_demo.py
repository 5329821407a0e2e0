"""`make gateway` (tests/_support/gateway_demo.py) and the README's commands against it: the curl of the
README streams an answer with the decision headers, and `quillctl gateway` lists both engines.
The demo runs with every port moved by an offset (the defaults may be taken on a test machine)."""
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quillcache import Client
from tests._support import gateway_demo as demo_ports

ROOT = Path(__file__).resolve().parents[2]
# every port the demo uses
PORTS = (demo_ports.GATEWAY_PORT, demo_ports.ADMIN_PORT, demo_ports.NODE_PORT, demo_ports.NODE_METRICS_PORT,
         *(p for _, *ports in demo_ports.ENGINES for p in ports))


def free_offset() -> int:
    # a random start: two checkouts running this test at once must not both take the first free range
    offsets = list(range(20000, 40000, 97))
    random.shuffle(offsets)
    for offset in offsets:
        try:
            for p in PORTS:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + offset))
        except OSError:
            continue
        return offset
    raise AssertionError("no free port range for the demo")


def readme_block(after: str) -> str:
    """The first ```sh block of the README after the line containing ``after``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text[text.index(after):], re.S)
    return block.group(1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's command uses curl")
def test_make_gateway_then_the_readme_curl_and_quillctl_gateway(tmp_path):
    offset = free_offset()
    # its own session, so that SIGINT goes to its whole group as a terminal's Ctrl-C does
    demo = subprocess.Popen([sys.executable, "-m", "tests._support.gateway_demo", "--port-offset", str(offset)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        out = b""
        sel = selectors.DefaultSelector()
        sel.register(demo.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 90
        while b"Ctrl-C stops everything" not in out:
            assert demo.poll() is None and time.monotonic() < deadline, out.decode(errors="replace")
            if sel.select(1.0):
                out += os.read(demo.stdout.fileno(), 65536)
        gw = 8088 + offset
        commands = (readme_block("The gateway: `make gateway`").replace("8089", str(gw + 1))   # admin_listen
                    .replace("8088", str(gw)).strip().split("\n"))
        curl = " ".join(line.rstrip("\\").strip() for line in commands if not line.startswith(".venv"))
        assert curl.startswith("curl ")
        r = subprocess.run(["bash", "-c", curl], capture_output=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        head, _, body = r.stdout.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 200")
        for h in ("x-quillcache-worker: sim-", "x-quillcache-overlap-blocks: device=", "x-quillcache-plan: hit="):
            assert h in head.lower(), head
        assert body.count("data: {") == 8 and body.rstrip().endswith("data: [DONE]")
        # the README's own quillctl line, at [gateway] admin_listen (8089 + offset)
        ctl = next(line.split("#")[0].split() for line in commands if line.startswith(".venv/bin/quillctl gateway"))
        assert f"127.0.0.1:{gw + 1}" in ctl
        r = subprocess.run([str(Path(sys.executable).with_name("quillctl")), *ctl[1:]],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert {line.split()[0] for line in r.stdout.splitlines()[1:]} == {"sim-0", "sim-1"}
        # and the quillctl line the demo itself prints: the same admin address
        printed = next(line.split("#")[0].split() for line in out.decode().splitlines()
                       if line.strip().startswith(".venv/bin/quillctl gateway"))
        assert printed[1:] == ctl[1:], (printed, ctl)

        # the engines share the node as their pool: the printed prompt, to one engine then to
        # the other, is loaded from the node the second time
        pool_curls = [line.strip() for line in out.decode().splitlines() if "/v1/completions" in line
                      and "max_tokens\": 1" in line]
        assert len(pool_curls) == 2
        answers = []
        for curl in pool_curls:
            r = subprocess.run(["bash", "-c", curl], capture_output=True, timeout=60, cwd=ROOT)
            assert r.returncode == 0, r.stderr
            answers.append(json.loads(r.stdout)["usage"]["prompt_tokens_details"])
            if len(answers) == 1:          # the first engine's save is asynchronous: wait until stored
                with Client(f"127.0.0.1:{demo_ports.NODE_PORT + offset}") as c:
                    deadline = time.monotonic() + 10
                    while c.stats("store")["store"]["puts"] < 3 and time.monotonic() < deadline:
                        time.sleep(0.05)
        assert answers[0]["pool_tokens"] == 0 and answers[1]["pool_tokens"] >= 48, answers
    finally:
        os.killpg(demo.pid, signal.SIGINT)          # Ctrl-C: the whole group
        try:
            rest = demo.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            demo.kill()
            rest = demo.communicate()[0]
        leftover = (ROOT / "var" / f"gateway-demo-{offset}").exists()
        shutil.rmtree(ROOT / "var" / f"gateway-demo-{offset}", ignore_errors=True)
    text = (out + rest).decode(errors="replace")
    assert demo.returncode == 0, text
    assert "exited with code" not in text and "make gateway: stopped" in text
    assert not leftover
