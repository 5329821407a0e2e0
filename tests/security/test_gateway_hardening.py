"""What an unauthenticated peer can make the gateway spend, and what a tenant can make it
forward (issue 22, item 6; issue 23's JSON errors), probed against a real quillcache-gateway
process in front of a real simulated engine:

* a body trickled a byte at a time is cut off at ``client_body_timeout`` with a 408;
* a client that stops reading a streamed answer is dropped at ``client_send_timeout``, and its
  upstream request and router load with it;
* 1,000 silent connections against a 1,024-descriptor limit: the connections past
  ``max_connections`` get a 503 (not a reset), the silent ones are closed at
  ``client_header_timeout``, and then a legitimate request is served;
* one peer address cannot take more than ``max_connections_per_peer`` of them;
* a client's own ``kv_transfer_params`` never reaches the engine;
* a wrong path or method gets an OpenAI-shaped JSON error.
"""
from __future__ import annotations

import json
import socket
import time

from tests._support.gateway_proc import TENANT_KEYS, GatewayProcess


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """What the peer sent within ``seconds``, and whether it closed the connection."""
    data, deadline = b"", time.monotonic() + seconds
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def test_a_body_trickled_byte_by_byte_is_cut_off_at_the_body_timeout(tmp_path):
    with GatewayProcess(tmp_path, gateway_toml='client_body_timeout = "2s"') as gp:
        s = _connect(gp.port)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {TENANT_KEYS['bob']}\r\n"
                "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n").encode()
        s.sendall(head)
        t0, answer, closed = time.monotonic(), b"", False
        s.settimeout(0.5)
        while time.monotonic() - t0 < 12 and not closed:
            try:
                s.sendall(b" ")                          # one byte every half second
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            data, closed = _read_until_closed(s, 0.5)
            answer += data
        elapsed = time.monotonic() - t0
        s.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "timeout_error"
        assert closed and elapsed < 6, elapsed
        assert gp.complete("still serving", "bob")[0] == 200


def test_a_client_that_stops_reading_its_answer_is_dropped_with_its_upstream_request(tmp_path):
    # An answer of 400,000 tokens (~60 MB of events): far more than the sockets between the
    # gateway and the client hold, and far longer to generate than the test waits.
    long = ("--max-model-len", "500000", "--capacity-blocks", "40000")
    with GatewayProcess(tmp_path, gateway_toml='client_send_timeout = "1s"', time_scale=0.01, engine_args=long) as gp:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # a small window, never read
        s.connect(("127.0.0.1", gp.port))
        body = json.dumps({"model": "m", "prompt": "tell me everything", "max_tokens": 400000, "stream": True})
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {TENANT_KEYS['bob']}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        try:
            deadline = time.monotonic() + 10
            while gp.engine_stats()["running"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gp.engine_stats()["running"] == 1                     # it is being answered
            # The gateway drops the client that takes nothing, and the engine aborts the request.
            deadline = time.monotonic() + 15
            while gp.engine_stats()["aborted"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = gp.engine_stats()
            assert stats["aborted"] == 1 and stats["running"] == 0, stats
            worker = json.loads(gp.get("/quillcache/workers", admin=True)[2])["workers"][0]
            assert worker["in_flight"] == 0 and worker["active_requests"] == 0
            metrics = gp.get("/metrics", admin=True)[2]
            assert b'quillcache_gateway_client_timeouts_total{stage="send"} 1.0' in metrics
        finally:
            s.close()
        assert gp.complete("next", "alice")[0] == 200


def test_silent_connections_cannot_exhaust_the_descriptors_or_lock_out_a_client(tmp_path):
    with GatewayProcess(tmp_path, nofile=1024, gateway_toml='client_header_timeout = "2s"') as gp:
        silent = []
        try:
            for _ in range(1000):
                silent.append(_connect(gp.port))
            # Past the limit: an answer, not a reset or a hang.
            st, hd, body = gp.complete("a legitimate request", "alice")
            assert st == 503 and json.loads(body)["error"]["type"] == "unavailable"
            assert hd.get("Retry-After") == "1"
            late, closed = _read_until_closed(silent[-1], 2.0)      # one past the limit: told so
            assert late.startswith(b"HTTP/1.1 503") and closed
            st, _, metrics = gp.get("/metrics", admin=True)          # the operator still sees it
            assert st == 200 and b'connections_refused_total{reason="max_connections"}' in metrics
            # The silent ones are closed at the header timeout; the client is served again.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    st, _, _ = gp.complete("a legitimate request", "alice")
                except OSError:                         # refused while it was still sending
                    st = 0
                if st == 200:
                    break
                time.sleep(0.5)
            assert st == 200
            assert all(_read_until_closed(s, 0.5) == (b"", True) for s in silent[:20])
        finally:
            for s in silent:
                s.close()
        assert gp.proc.poll() is None
        assert "does not fit the descriptor limit" in gp.log()


def test_one_peer_cannot_take_every_connection_slot(tmp_path):
    with GatewayProcess(tmp_path, gateway_toml="max_connections_per_peer = 10") as gp:
        silent = [_connect(gp.port) for _ in range(10)]          # from 127.0.0.1
        try:
            st, _, body = gp.complete("from the same address", "alice")
            assert st == 503 and b"too many connections" in body
            assert gp.complete("from another address", "alice", source="127.0.0.2")[0] == 200
        finally:
            for s in silent:
                s.close()
        deadline = time.monotonic() + 5
        while gp.complete("again", "alice")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)                                       # its slots come back as they close
        assert gp.complete("again", "alice")[0] == 200
        st, _, body = gp.get("/metrics", admin=True)
        assert b'quillcache_gateway_connections_refused_total{reason="max_connections_per_peer"}' in body


def test_a_clients_kv_transfer_params_never_reach_the_engine(tmp_path):
    with GatewayProcess(tmp_path) as gp:
        forged = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "victim",
                  "remote_block_ids": list(range(40)), "remote_host": "127.0.0.1", "remote_port": 1}
        prompt = "x" * (40 * 16 + 5)
        st, _, body = gp.complete(prompt, "bob", kv_transfer_params=forged, request_id="alice-req-1")
        assert st == 200, body
        stats = gp.engine_stats()
        assert stats["remote_tokens"] == 0 and stats["prompt_tokens"] == len(prompt)


def test_a_wrong_path_or_method_gets_an_openai_json_error(tmp_path):
    with GatewayProcess(tmp_path) as gp:
        for method, path, admin, status in (("GET", "/v1/completions", False, 405),
                                            ("POST", "/v1/models", False, 405),
                                            ("GET", "/v1/nothing-here", False, 404),
                                            ("DELETE", "/metrics", True, 405),
                                            ("GET", "/v1/completions", True, 404)):
            st, hd, body = gp.request(method, path, admin=admin)
            assert st == status, (method, path)
            assert hd["Content-Type"].startswith("application/json"), (method, path)
            err = json.loads(body)["error"]
            assert err["code"] == status and err["message"] and err["type"], (method, path)
            if status == 405:
                assert "Allow" in hd and path in err["message"]
