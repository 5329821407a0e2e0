"""No prompt oracle through the gateway (issue 22, item 4), probed from outside against a real
quillcache-gateway process in front of a real simulated engine, with two tenants:

* bob's request for alice's cached prompt, carol's for a guess sharing part of it, and one for
  a prompt nobody cached get the same x-quillcache-* headers (no ``reuse-refused``, no decision time);
* the same with the operator's identity-blind policy (``[router] policy = "dynamo"``);
* the operator's endpoints (/metrics, /quillcache/workers, /quillcache/hot) are not on the
  tenants' address, with or without a key; they answer on the admin address;
* the served models and adapters (whose names may be a tenant's own) need a key.
"""
from __future__ import annotations

import json
import time

import pytest

from tests._support.gateway_proc import GatewayProcess, decision

BLOCK = 16                                        # characters per block (approximate tokenizer)
PROMPT = "".join(f"alice's private note {i:04d}. " for i in range(20))[:33 * BLOCK]
GUESS = PROMPT[:6 * BLOCK] + "".join(f"a guess at the rest {i:04d}. " for i in range(20))[:27 * BLOCK]
UNSEEN = "".join(f"nobody ever sent this {i:04d}. " for i in range(20))[:33 * BLOCK]
ADMIN_PATHS = ("/metrics", "/quillcache/workers", "/quillcache/hot?n=10")


def _alice_caches_her_prompt(gp: GatewayProcess) -> None:
    st, _, _ = gp.complete(PROMPT, "alice")
    assert st == 200
    deadline = time.monotonic() + 10              # predict-on-route, then the engine's events
    while time.monotonic() < deadline:
        st, hd, _ = gp.complete(PROMPT, "alice")
        if st == 200 and decision(hd)["local-hits"] == "33":
            return
        time.sleep(0.2)
    raise AssertionError("alice's own prompt never showed as cached for her")


def _bob_sees_nothing(gp: GatewayProcess) -> None:
    """Bob sends alice's prompt, carol a guess sharing its first 6 blocks (a tenant's own
    earlier request is its own cache: each probe is the first of its tenant)."""
    seen = {}
    for name, prompt, tenant in (("unseen", UNSEEN, "bob"), ("alice's", PROMPT, "bob"), ("guess", GUESS, "carol")):
        st, hd, body = gp.complete(prompt, tenant)
        assert st == 200, body
        seen[name] = decision(hd)
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # the engine's too
    assert seen["unseen"]["local-hits"] == "0"
    assert seen["alice's"] == seen["unseen"] and seen["guess"] == seen["unseen"], seen
    assert not set(seen["unseen"]) & {"reuse-refused", "decision-us"}


@pytest.mark.parametrize("policy", ["quillcache", "dynamo"])
def test_another_tenants_prompt_gets_the_headers_of_a_prompt_nobody_cached(tmp_path, policy):
    with GatewayProcess(tmp_path, router_toml=f'policy = "{policy}"') as gp:
        _alice_caches_her_prompt(gp)
        _bob_sees_nothing(gp)


def test_the_operators_endpoints_are_not_on_the_tenants_address(tmp_path):
    with GatewayProcess(tmp_path) as gp:
        _alice_caches_her_prompt(gp)
        for path in ADMIN_PATHS:
            for tenant in (None, "bob"):
                st, hd, body = gp.request("GET", path, tenant=tenant)
                assert st == 404, (path, tenant)
                assert hd["Content-Type"].startswith("application/json")
                assert json.loads(body)["error"]["code"] == 404
                assert b"quillcache_gateway" not in body and b"block_hash" not in body
        st, _, body = gp.get("/quillcache/hot?n=10", admin=True)
        assert st == 200 and json.loads(body)["hot"][0]["count"] >= 2
        st, _, body = gp.get("/metrics", admin=True)
        assert st == 200 and b"quillcache_gateway_reuse_refused_blocks_total" in body
        st, _, body = gp.get("/quillcache/workers", admin=True)
        assert st == 200 and [w["id"] for w in json.loads(body)["workers"]] == ["e0"]
        assert gp.get("/health")[0] == 200                  # load balancers still see health


def test_the_served_models_and_adapters_are_listed_to_a_client_with_a_key_only(tmp_path):
    with GatewayProcess(tmp_path) as gp:
        st, _, body = gp.request("GET", "/v1/models")
        assert st == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        st, _, body = gp.request("GET", "/v1/models", tenant="bob")
        assert st == 200 and [m["id"] for m in json.loads(body)["data"]] == ["m"]
