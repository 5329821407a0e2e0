"""Engine records in etcd are signed with the pool's credential, and a gateway that discovers
engines in etcd routes only to those (docs/security.md, the etcd writer's row).

A real etcd, a real quillcache-gateway process with ``[cluster] enabled`` and its credential, a
real quillcache-sim-engine that registers itself with the credential, and an etcd writer who
knows no credential: it makes up engine records pointing at a listener of its own (unsigned;
registered by a real registrant with another credential; written over the genuine engine's
key), and copies the genuine record under another engine id.  The gateway must route to the
genuine engine only and never connect to the writer's listener (neither its URL nor its
KV-event endpoint).
"""
from __future__ import annotations

import base64
import json
import socket
import threading
import time
import urllib.request

import pytest

from quillcache.cluster.engines import EngineRegistration
from quillcache.cluster.keys import ClusterKeys
from tests._support.etcd import EtcdServer, etcd_binary
from tests._support.gateway_proc import GatewayProcess, decision
from tests._support.sim import SimEngine

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)")

CID = "signed"
CREDENTIAL = "engine-records-credential-0123"
OTHER_CREDENTIAL = "not-this-pools-credential-4567"


class Listener:
    """A TCP listener that counts the connections it is sent (the etcd writer's 'engine')."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _etcd_call(etcd, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{etcd.endpoint}/v3{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _put(etcd, engine_id: str, value: bytes) -> None:
    _etcd_call(etcd, "/kv/put", {"key": _b64(f"/quillcache/{CID}/engines/{engine_id}".encode()), "value": _b64(value)})


def _get(etcd, engine_id: str) -> bytes:
    """The record's bytes, or b"" while there is none (etcd's range answer then has no "kvs":
    the registrant may not have written it yet)."""
    res = _etcd_call(etcd, "/kv/range", {"key": _b64(f"/quillcache/{CID}/engines/{engine_id}".encode())})
    kvs = res.get("kvs") or []
    return base64.b64decode(kvs[0]["value"]) if kvs else b""


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_gateway_routes_only_to_engines_whose_records_the_pools_credential_signs(tmp_path):
    credential_file = tmp_path / "credential"
    credential_file.write_text(CREDENTIAL + "\n")
    credential_file.chmod(0o600)
    evil = Listener()
    evil_record = {"url": f"http://127.0.0.1:{evil.port}", "model": "m", "kv_events": f"tcp://127.0.0.1:{evil.port}"}
    with EtcdServer(tmp_path / "etcd") as etcd:
        cluster = (f'[cluster]\nenabled = true\netcd = ["{etcd.endpoint}"]\ncluster_id = "{CID}"\n'
                   f'credential = "{CREDENTIAL}"\n')
        good = SimEngine(model="m", etcd=etcd.endpoint, cluster_id=CID, engine_id="good", lease_ttl="3s",
                         credential_file=str(credential_file))
        other = EngineRegistration(endpoints=[(etcd.host, etcd.port)], cluster_id=CID, ttl=3.0,
                                   keys=ClusterKeys(OTHER_CREDENTIAL, CID), record={"id": "evil-other", **evil_record})
        try:
            good.start()
            other.start()
            assert other.registered.wait(10)                 # a real registrant, the wrong credential
            _wait(lambda: b'"sig"' in _get(etcd, "good"), 10, "the genuine record")
            genuine = _get(etcd, "good")
            _put(etcd, "evil-unsigned", json.dumps({"id": "evil-unsigned", **evil_record}).encode())
            _put(etcd, "evil-copy", genuine)                  # signed, but for the key of "good"
            with GatewayProcess(tmp_path, router_toml='policy = "round_robin"', extra_toml=cluster,
                                time_scale=0.001) as gp:
                def workers() -> dict:
                    return json.loads(gp.get("/quillcache/workers", admin=True)[2])

                _wait(lambda: {w["id"] for w in workers()["workers"]} == {"e0", "good"}, 15, "good joined")
                # The writer now also overwrites the genuine engine's record with its own.
                _put(etcd, "good", json.dumps({"id": "good", **evil_record}).encode())
                _wait(lambda: "the record under /quillcache/signed/engines/good is refused" in gp.log(), 10,
                      "the overwrite refused")
                served = []
                for i in range(8):
                    status, headers, body = gp.complete(f"request {i} " * 20)
                    assert status == 200, body
                    served.append(decision(headers)["worker"])
                doc = workers()
                log = gp.log()
        finally:
            other.stop()
            good.stop()
    evil.close()
    assert set(served) == {"e0", "good"}                      # round robin over the genuine two
    assert {w["id"] for w in doc["workers"]} == {"e0", "good"}
    assert doc["workers"][[w["id"] for w in doc["workers"]].index("good")]["url"] == good.url
    assert doc["cluster"]["records_refused"] >= 4 and doc["cluster"]["engines"] == ["good"]
    for name in ("evil-unsigned", "evil-other", "evil-copy", "good"):
        assert f"engines/{name} is refused: not signed with this pool's record key" in log, name
    assert CREDENTIAL not in log
    assert evil.accepted == 0                                 # never dialled: not its URL, not its events
