"""Engines from etcd: a real etcd, real simulated engines that register themselves
(quillcache-sim-engine --etcd, quillctl engine register), a gateway that adds and removes them
live, and keeps serving while etcd is down."""
import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from quillcache.cluster.engines import EngineRegistration
from quillcache.cluster.keys import ClusterKeys
from tests._support.etcd import EtcdServer, etcd_binary
from tests._support.gateway import gateway, wait_until
from tests._support.sim import SimEngine

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)")

CID = "gwtest"
TTL_S = 2                       # the engines' lease TTL (etcd's shortest is about 2 s)
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
QUILLCTL = str(Path(sys.executable).with_name("quillctl"))
CREDENTIAL = "discovery-test-credential-0123"      # the pool's [cluster] credential
KEYS = ClusterKeys(CREDENTIAL, CID)


@pytest.fixture
def etcd(tmp_path):
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


@pytest.fixture
def credential_file(tmp_path):
    path = tmp_path / "credential"
    path.write_text(CREDENTIAL + "\n")
    path.chmod(0o600)
    return str(path)


def cluster_toml(etcd, engines: str = "", policy: str = "round_robin") -> str:
    return (f'[gateway]\nunhealthy_after = "30s"\n{engines}\n[router]\npolicy = "{policy}"\n'
            f'[cluster]\nenabled = true\netcd = ["{etcd.endpoint}"]\ncluster_id = "{CID}"\n'
            f'credential = "{CREDENTIAL}"\n')


def registered(etcd, engine_id: str, credential_file: str, **flags) -> SimEngine:
    return SimEngine(model="m", etcd=etcd.endpoint, cluster_id=CID, engine_id=engine_id,
                     lease_ttl=f"{TTL_S}s", credential_file=credential_file, **flags)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


async def ask(session, base, prompt=PROMPT, model="m"):
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}
    async with session.post(base + "/v1/completions", json=body) as r:
        data = await r.read()
        return r.status, r.headers.get("x-quillcache-worker"), data


async def workers(session, admin) -> dict:
    async with session.get(admin + "/quillcache/workers") as r:
        return await r.json()


def test_an_engine_registered_after_start_gets_traffic_and_one_whose_lease_expires_stops(etcd, credential_file):
    async def main():
        loop = asyncio.get_running_loop()
        async with gateway(cluster_toml(etcd)) as (gw, base, admin, s):
            assert gw.discovery.state == "ok" and not gw.engines
            async with s.get(base + "/health") as r:
                assert r.status == 503                        # nothing to route to yet
            assert (await ask(s, base))[0] == 404
            a = await loop.run_in_executor(None, registered(etcd, "late-a", credential_file,
                                                            capacity_blocks=200).start)
            b = await loop.run_in_executor(None, registered(etcd, "late-b", credential_file,
                                                            capacity_blocks=300).start)
            try:
                await wait_until(lambda: {"late-a", "late-b"} <= set(gw.engines), 10, "both engines joined")
                # each said its KV memory when it joined ([router] learn_kv_blocks): the smaller counts
                router = gw.router.models["m"].router
                await wait_until(lambda: router.config.kv_blocks == 200, 10, "the engines' KV pages learned")
                seen = [await ask(s, base, f"{i} {PROMPT}") for i in range(4)]
                assert {st for st, _, _ in seen} == {200}
                assert {w for _, w, _ in seen} == {"late-a", "late-b"}      # round robin: both serve
                doc = await workers(s, admin)
                assert {w["id"]: w["source"] for w in doc["workers"]} == {"late-a": "etcd", "late-b": "etcd"}
                assert doc["cluster"]["state"] == "ok" and doc["cluster"]["rejected"] == {}
                # late-a stops dead (SIGSTOP): it can no longer keep its lease alive.
                os.kill(a.proc.pid, signal.SIGSTOP)
                took = await wait_until(lambda: "late-a" not in gw.engines, TTL_S + 5, "late-a left")
                assert took <= TTL_S + 3
                # late-b's, now the only one (once the gateway has closed late-a's event stream)
                await wait_until(lambda: router.config.kv_blocks == 300, 5, "late-a's KV figure dropped")
                seen = [await ask(s, base, f"x{i} {PROMPT}") for i in range(4)]
                assert [(st, w) for st, w, _ in seen] == [(200, "late-b")] * 4
                # A clean stop withdraws at once (the lease is revoked), no TTL to wait.
                await loop.run_in_executor(None, b.stop)
                took = await wait_until(lambda: not gw.engines, 5, "late-b left")
                assert took < TTL_S
                assert (await ask(s, base))[0] == 404
            finally:
                if a.proc is not None:
                    os.kill(a.proc.pid, signal.SIGCONT)
                a.stop(signal.SIGKILL)
                b.stop()
    run(main())


def test_etcd_down_keeps_the_last_view_and_serving(etcd, credential_file):
    async def main():
        loop = asyncio.get_running_loop()
        eng = await loop.run_in_executor(None, registered(etcd, "steady", credential_file).start)
        try:
            async with gateway(cluster_toml(etcd)) as (gw, base, admin, s):
                await wait_until(lambda: "steady" in gw.engines, 10, "steady joined")
                assert (await ask(s, base))[:2] == (200, "steady")
                await loop.run_in_executor(None, etcd.stop, signal.SIGKILL)
                await wait_until(lambda: gw.discovery.state == "degraded", 10, "the view is degraded")
                await asyncio.sleep(TTL_S + 1)                 # past the engine's lease TTL
                for i in range(5):
                    assert (await ask(s, base, f"{i} {PROMPT}"))[:2] == (200, "steady")
                metrics = await (await s.get(admin + "/metrics")).text()
                assert 'quillcache_gateway_etcd_state{state="degraded"} 1.0' in metrics
                await loop.run_in_executor(None, etcd.start)
                await wait_until(lambda: gw.discovery.state == "ok", 15, "etcd back")
                await asyncio.sleep(1.0)                       # the engine's registrant is back too
                assert "steady" in gw.engines
                assert (await ask(s, base))[:2] == (200, "steady")
        finally:
            eng.stop()
    run(main())


def test_records_the_gateway_cannot_serve_are_refused_with_a_reason_and_the_config_wins(etcd):
    async def main():
        loop = asyncio.get_running_loop()
        static = await loop.run_in_executor(None, SimEngine(model="m", events=False).start)
        records = [
            {"id": "e-static", "url": "http://127.0.0.1:1", "model": "m"},        # the config's id
            {"id": "bad-url", "url": "ftp://x", "model": "m"},
            {"id": "other-blocks", "url": "http://127.0.0.1:2", "model": "m", "block_size": 32},
        ]
        regs = [EngineRegistration(endpoints=[(etcd.host, etcd.port)], cluster_id=CID, record=r, ttl=TTL_S,
                                   keys=KEYS) for r in records]
        try:
            for reg in regs:
                reg.start()
            engines = f'[[gateway.engines]]\nid = "e-static"\nurl = "{static.url}"\nmodel = "m"\n'
            async with gateway(cluster_toml(etcd, engines)) as (gw, base, admin, s):
                await wait_until(lambda: len(gw.discovery.rejected) == 3, 10, "three refusals")
                why = (await workers(s, admin))["cluster"]["rejected"]
                assert "config's entry is served" in why["e-static"]
                assert "must be http" in why["bad-url"]
                assert "block_size 32 differs from engine e-static's 16" in why["other-blocks"]
                assert list(gw.engines) == ["e-static"] and gw.engines["e-static"].spec.url == static.url
                assert (await ask(s, base))[:2] == (200, "e-static")
                for reg in regs:
                    await loop.run_in_executor(None, reg.stop)
                await wait_until(lambda: not gw.discovery.rejected, 5, "refusals cleared")
        finally:
            for reg in regs:
                reg.stop()
            static.stop()
    run(main())


def test_quillctl_engine_register_keeps_a_plain_engine_registered_while_it_is_healthy(etcd):
    async def main():
        loop = asyncio.get_running_loop()
        eng = await loop.run_in_executor(None, SimEngine(model="m").start)      # knows nothing of etcd
        argv = [QUILLCTL, "engine", "register", "--etcd", etcd.endpoint, "--cluster-id", CID,
                "--id", "vllm-0", "--url", eng.url, "--model", "m", "--kv-events", eng.events,
                "--kv-replay", eng.replay, "--lease-ttl", f"{TTL_S}s", "--health-interval", "0.2"]
        # The credential from the environment this time (the other registrants read a file).
        sidecar = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "QUILLCACHE_CLUSTER_CREDENTIAL": CREDENTIAL})
        try:
            async with gateway(cluster_toml(etcd)) as (gw, base, admin, s):
                await wait_until(lambda: "vllm-0" in gw.engines, 10, "vllm-0 joined")
                assert gw.engines["vllm-0"].spec.kv_events == eng.events
                assert (await ask(s, base))[:2] == (200, "vllm-0")
                await loop.run_in_executor(None, eng.stop)      # the engine goes: its /health fails
                await wait_until(lambda: "vllm-0" not in gw.engines, 5, "vllm-0 withdrawn")
                sidecar.send_signal(signal.SIGTERM)
                assert await loop.run_in_executor(None, sidecar.wait, 10) == 0
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
            err = sidecar.communicate()[1]
            eng.stop()
        assert "registering vllm-0" in err and "withdrawn" in err
    run(main())


def test_a_bad_registration_is_a_usage_error_before_anything_is_written(etcd):
    r = subprocess.run([QUILLCTL, "engine", "register", "--etcd", etcd.endpoint, "--id", "x y",
                        "--url", "http://127.0.0.1:1", "--model", "m"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "id 'x y' must be 1-128" in r.stderr
    every_key = {"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode()}
    req = urllib.request.Request(f"http://{etcd.endpoint}/v3/kv/range", data=json.dumps(every_key).encode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert "kvs" not in json.load(resp)                  # nothing was written


def _etcd_is_empty(etcd) -> bool:
    every_key = {"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode()}
    req = urllib.request.Request(f"http://{etcd.endpoint}/v3/kv/range", data=json.dumps(every_key).encode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        return "kvs" not in json.load(resp)


def test_a_registrant_without_the_credential_refuses_to_register(etcd, tmp_path):
    # An unsigned record would be refused by every gateway: both registrants say so and exit 2
    # before anything is written, and a credential too short is refused the same way.
    env = {k: v for k, v in os.environ.items() if k != "QUILLCACHE_CLUSTER_CREDENTIAL"}
    short = tmp_path / "short"
    short.write_text("too-short\n")
    ctl = [QUILLCTL, "engine", "register", "--etcd", etcd.endpoint, "--cluster-id", CID, "--id", "e0",
           "--url", "http://127.0.0.1:1", "--model", "m", "--health-interval", "0"]
    sim = [str(Path(sys.executable).with_name("quillcache-sim-engine")), "--port", "0", "--etcd", etcd.endpoint,
           "--cluster-id", CID]
    for argv in (ctl, sim):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 2, r.stderr
        assert "no cluster credential: give --credential-file PATH" in r.stderr
        assert "QUILLCACHE_CLUSTER_CREDENTIAL" in r.stderr
        r = subprocess.run(argv + ["--credential-file", str(short)], capture_output=True, text=True, timeout=30,
                           env=env)
        assert r.returncode == 2 and "needs at least 16 characters" in r.stderr, r.stderr
        assert "too-short" not in r.stderr                   # the credential is never echoed
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                           env={**env, "QUILLCACHE_CLUSTER_CREDENTIAL": "short"})
        assert r.returncode == 2 and "QUILLCACHE_CLUSTER_CREDENTIAL: the cluster credential needs" in r.stderr
    assert _etcd_is_empty(etcd)
