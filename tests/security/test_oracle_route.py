"""No prompt oracle in the node's hosted router (issue 22, items 4 and 5), probed as an
attacker would: two tenants over the binary protocol against a real quillcached whose
router consumes a real engine's KV events (a ZMQ publisher) cached under tenant alice.

* bob's ROUTE for alice's prompt, for a guess sharing part of it, and for a prompt nobody
  cached get the same answer in every figure;
* bob cannot name the identity-blind policy; with the operator's identity-blind module the
  answer's figures are still bob's own;
* request ids are 128 random bits and a caller's own: bob's ROUTE_UPDATE does not touch
  alice's requests, and bob's ROUTE with alice's id does not take hers over;
* INFO, which every tenant may read, carries no count of refused blocks.
"""
from __future__ import annotations

import re
import time

import pytest

from quillcache.client import Client
from quillcache.control.events import BlockStored, EventPublisher
from quillcache.errors import PermissionDenied
from quillcache.model import IdentityScope
from quillcache.settings.convert import hash_token
from tests._support.daemon import Daemon
from tests._support.net import free_port

BS = 4
TOKENS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789"}
ALICE = IdentityScope("llama", "llama-tok", None, "alice")
BOB = IdentityScope("llama", "llama-tok", None, "bob")
PROMPT = list(range(1000, 1040))                     # alice's prompt: 10 blocks
GUESS = PROMPT[:24] + list(range(5000, 5016))        # shares 6 blocks with it
UNSEEN = list(range(9000, 9040))                     # nobody cached it


def _tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _node(tmp_path, module: str, pub: EventPublisher) -> Daemon:
    router = (f'module = "{module}"\nblock_size = {BS}\n[[router.engines]]\nid = "e0"\n'
              f'endpoint = "{pub.endpoint}"\nreplay_endpoint = "{pub.replay_endpoint}"\nmodel = "llama"\n'
              'tokenizer = "llama-tok"\ntenant = "alice"\n')
    tenants = "".join(f'[[auth.tenants]]\nname = "{n}"\ntoken = "{hash_token(t)}"\n' for n, t in TOKENS.items())
    return Daemon(tmp_path, sections={"router": router, "auth": tenants})


def _cached_for_alice(d: Daemon, pub: EventPublisher) -> None:
    """Publish alice's prompt until the router has indexed it (ZMQ's slow joiner)."""
    stored = BlockStored(tuple(range(100, 110)), None, tuple(PROMPT), BS, medium="GPU")
    with Client(d.addr, token=TOKENS["alice"]) as alice:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pub.publish([stored])
            if alice.route(ALICE, PROMPT, track=False, policy="quillcache").device == 10:
                return
            time.sleep(0.1)
    raise AssertionError("the router never indexed alice's blocks")


def _seen_by(reply):
    """Everything a reply tells, less its own request id."""
    return reply._replace(request_id="")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    pub = EventPublisher(_tcp(), _tcp(), topic="")
    d = _node(tmp_path_factory.mktemp("oracle"), "quillcache", pub)
    d.start()
    try:
        _cached_for_alice(d, pub)
        yield d
    finally:
        assert d.stop() == 0
        pub.close()


def test_another_tenants_prompt_gets_the_same_answer_as_a_prompt_nobody_cached(node):
    with Client(node.addr, token=TOKENS["bob"]) as bob:
        unseen = _seen_by(bob.route(BOB, UNSEEN, track=False))
        assert unseen.device == 0 and unseen.plan == bytes([4] * 10)
        assert _seen_by(bob.route(BOB, PROMPT, track=False)) == unseen
        assert _seen_by(bob.route(BOB, GUESS, track=False)) == unseen
        for policy in ("quillcache", "prefix", "least_loaded"):
            assert _seen_by(bob.route(BOB, PROMPT, track=False, policy=policy)) == \
                _seen_by(bob.route(BOB, UNSEEN, track=False, policy=policy))


def test_a_tenant_cannot_name_the_identity_blind_policy(node):
    with Client(node.addr, token=TOKENS["bob"]) as bob:
        with pytest.raises(PermissionDenied, match="identity-blind"):
            bob.route(BOB, PROMPT, track=False, policy="dynamo")
        assert bob.route(BOB, UNSEEN, track=False).device == 0    # the connection stays usable


def test_router_named_request_ids_are_128_random_bits(node):
    with Client(node.addr, token=TOKENS["alice"]) as alice:
        ids = [alice.route(ALICE, PROMPT).request_id for _ in range(3)]
        for rid in ids:
            assert re.fullmatch(r"[0-9a-f]{32}", rid), rid
            assert alice.route_update(rid) is True
    assert len(set(ids)) == 3


def test_route_update_acts_only_on_the_callers_own_requests(node):
    with Client(node.addr, token=TOKENS["alice"]) as alice, Client(node.addr, token=TOKENS["bob"]) as bob:
        rid = alice.route(ALICE, PROMPT).request_id
        assert bob.route_update(rid, first_token=True) is False
        assert bob.route_update(rid) is False
        assert alice.route_update(rid, first_token=True) is True
        assert alice.route_update(rid) is True


def test_a_request_id_chosen_by_two_tenants_stays_two_requests(node):
    with Client(node.addr, token=TOKENS["alice"]) as alice, Client(node.addr, token=TOKENS["bob"]) as bob:
        assert alice.route(ALICE, PROMPT, request_id="job-1").request_id == "job-1"
        assert bob.route(BOB, UNSEEN, request_id="job-1").request_id == "job-1"
        assert bob.route_update("job-1") is True          # bob ends his own job-1 ...
        assert alice.route_update("job-1") is True         # ... and alice's is still hers to end
        assert bob.route_update("job-1") is False


def test_info_readable_by_a_tenant_carries_no_refused_count(node):
    with Client(node.addr, token=TOKENS["bob"]) as bob:
        bob.route(BOB, PROMPT, track=False)
        router = bob.info("Router")["Router"]
    assert router["decisions"] >= 1
    assert not [k for k in router if "refused" in k or "cross" in k]


def test_with_the_operators_identity_blind_module_the_answer_is_still_the_tenants_own(tmp_path):
    pub = EventPublisher(_tcp(), _tcp(), topic="")
    d = _node(tmp_path, "dynamo", pub)
    try:
        with d:
            _cached_for_alice(d, pub)
            with Client(d.addr, token=TOKENS["bob"]) as bob:
                unseen = _seen_by(bob.route(BOB, UNSEEN, track=False))
                assert unseen.device == 0 and unseen.plan == bytes([4] * 10)
                assert _seen_by(bob.route(BOB, PROMPT, track=False)) == unseen
                assert _seen_by(bob.route(BOB, GUESS, track=False)) == unseen
            with Client(d.addr, token=TOKENS["alice"]) as alice:
                own = alice.route(ALICE, PROMPT, track=False)         # her own blocks: her figures
                assert (own.device, own.plan) == (10, bytes([0] * 10))
    finally:
        pub.close()
