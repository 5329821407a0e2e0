"""The node's HTTP port (node/metrics.py): /metrics, /health and /ready, and a 404 for any other
path, on a real quillcached and on NodeMetrics itself (readiness while draining or joining)."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from quillcache.node.metrics import HTTP_PATHS, NodeMetrics
from tests._support.daemon import Daemon


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_running_node_answers_health_ready_and_metrics_and_404_elsewhere(tmp_path):
    with Daemon(tmp_path) as d:
        assert get(d.metrics_port, "/health") == (200, "ok\n")
        assert get(d.metrics_port, "/ready") == (200, "ready\n")
        status, body = get(d.metrics_port, "/metrics")
        assert status == 200 and "quillcache_requests_total" in body and "quillcache_tier_hits_total" in body
        assert get(d.metrics_port, "/metrics?name[]=quillcache_connections")[0] == 200
        for path in ("/", "/healthz", "/metrics/x", "/favicon.ico"):
            status, body = get(d.metrics_port, path)
            assert status == 404 and "/metrics, /health, /ready" in body, (path, body)


def test_ready_says_503_with_the_reason_while_draining_or_joining():
    m = NodeMetrics("n1", "0.1.0")
    host, port = m.serve("127.0.0.1", 0)
    try:
        assert get(port, "/ready") == (200, "ready\n")
        m.set_cluster_state("starting")
        assert get(port, "/ready") == (503, "cluster state starting\n")
        m.set_cluster_state("ok")
        assert get(port, "/ready")[0] == 200
        m.set_ready(False, "draining")
        assert get(port, "/ready") == (503, "draining\n")
        assert get(port, "/health") == (200, "ok\n")              # alive while not ready
        m.set_ready(True)
        assert get(port, "/ready")[0] == 200
    finally:
        m.close()
    assert HTTP_PATHS == ("/metrics", "/health", "/ready")


@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_other_methods_are_refused(method):
    m = NodeMetrics("n1", "0.1.0")
    _, port = m.serve("127.0.0.1", 0)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/health", data=b"x", method=method)
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 501
    finally:
        m.close()


def test_ready_answers_503_draining_from_sigterm_until_the_node_stops(tmp_path):
    # A PUT held in flight (half its payload sent) keeps the node draining after SIGTERM:
    # meanwhile /ready must say 503 "draining" (a load balancer stops sending here) while
    # /health still says the process is alive.
    import signal
    import time

    from quillcache._native.codec import encode_frame_header
    from quillcache.model import encode_key
    from quillcache.protocol import messages
    from quillcache.protocol.opcodes import Opcode
    from tests._support.data import content, key
    from tests._support.net import raw_connect, read_frames

    with Daemon(tmp_path) as d:
        assert get(d.metrics_port, "/ready") == (200, "ready\n")
        s = raw_connect(d.port)
        payload = content(1, 1 << 20)
        s.sendall(encode_frame_header(Opcode.PUT, 7, header=messages.encode_put_request(encode_key(key(1)),
                                                                                        len(payload)),
                                      payload_length=len(payload)) + payload[:1000])
        time.sleep(0.3)
        d.send(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while get(d.metrics_port, "/ready")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(d.metrics_port, "/ready") == (503, "draining\n")
        assert get(d.metrics_port, "/health") == (200, "ok\n")
        assert d.proc.poll() is None                    # still draining: it waits for the PUT
        s.sendall(payload[1000:])
        frames = read_frames(s, 1)
        assert frames and frames[0].request_id == 7 and frames[0].status == 0
        assert d.wait(30) == 0
