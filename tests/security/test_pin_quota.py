"""Hard pins per tenant (issue 22, probe 7): one tenant cannot take the node's hard-pin budget
from the others, and a refusal tells a tenant nothing of another's pins.

On main before the quotas, alice could hard-pin the whole budget (half the DRAM arena) and
every pin of bob's then failed.  Against a real daemon with tenants: alice pins up to her
quota and is refused after it; bob still pins his."""
from __future__ import annotations

import signal
import time

import pytest

from quillcache import Client
from quillcache.errors import CapacityError
from quillcache.settings.convert import hash_token
from tests._support.daemon import Daemon
from tests._support.data import content, key
from tests._support.metrics import metric_value, scrape

BLOCK = 256 << 10        # bytes per block
DRAM = "12MiB"           # hard-pin budget: half of it, 6 MiB (24 blocks)
TOKENS = {"alice": "alice-secret", "bob": "bob-secret", "carol": "carol-secret"}


def _tenants(pin_bytes: dict[str, str]) -> str:
    out = []
    for name, token in TOKENS.items():
        out.append(f'[[auth.tenants]]\nname = "{name}"\ntoken = "{hash_token(token)}"')
        if name in pin_bytes:
            out.append(f'pin_bytes = "{pin_bytes[name]}"')
    return "\n".join(out)


def _daemon(tmp_path, pin_bytes: dict[str, str]) -> Daemon:
    return Daemon(tmp_path, dram=DRAM, max_block="1MiB", sections={"auth": _tenants(pin_bytes)})


def _put(c: Client, tenant: str, ids) -> list:
    keys = [key(i, tenant=tenant) for i in ids]
    for k in keys:
        c.put(k, content(k.block_index, BLOCK))
    return keys


def _pin_until_refused(c: Client, keys) -> tuple[int, CapacityError]:
    """Hard-pin keys in order; how many were pinned before the first refusal, and that refusal."""
    for n, k in enumerate(keys):
        try:
            c.pin(k, 600, hard=True)
        except CapacityError as exc:
            return n, exc
    pytest.fail(f"all {len(keys)} hard pins were accepted")


def test_without_pin_bytes_each_tenant_gets_an_even_share_and_cannot_starve_the_others(tmp_path):
    with _daemon(tmp_path, {}) as d, Client(d.addr, token="alice-secret") as alice, \
            Client(d.addr, token="bob-secret") as bob:
        share = (6 << 20) // 3 // BLOCK                      # 6 MiB budget over 3 tenants: 8 blocks
        pinned, refusal = _pin_until_refused(alice, _put(alice, "alice", range(share + 4)))
        assert pinned == share
        assert "quota of tenant 'alice'" in str(refusal) and f"{share * BLOCK} bytes pinned" in str(refusal)
        bob_keys = _put(bob, "bob", range(share))
        for k in bob_keys:                                  # bob still pins his whole share
            assert bob.pin(k, 600, hard=True)
        time.sleep(1.3)                                     # the metrics snapshot refreshes once a second
        text = scrape(d.metrics_port)
        assert metric_value(text, "quillcache_tenant_pins_refused_total", 'tenant="alice"') == 1
        assert metric_value(text, "quillcache_tenant_hard_pinned_bytes", 'tenant="bob"') == share * BLOCK
        assert metric_value(text, "quillcache_tenant_pin_quota_bytes", 'tenant="carol"') == share * BLOCK


def test_pin_bytes_caps_its_tenant_and_the_rest_is_shared_by_the_others(tmp_path):
    with _daemon(tmp_path, {"alice": "1MiB"}) as d, Client(d.addr, token="alice-secret") as alice, \
            Client(d.addr, token="bob-secret") as bob:
        pinned, refusal = _pin_until_refused(alice, _put(alice, "alice", range(8)))
        assert pinned == 4                                  # 1 MiB of 256 KiB blocks
        assert "is 1048576 bytes" in str(refusal) and refusal.requested == BLOCK and refusal.free == 0
        # bob and carol share the 5 MiB that alice's quota leaves: 10 blocks each
        pinned, _ = _pin_until_refused(bob, _put(bob, "bob", range(12)))
        assert pinned == 10


def test_a_refusal_tells_a_tenant_nothing_of_another_tenants_pins(tmp_path):
    """Bob's refusal is the same, word for word and figure for figure, whether alice holds
    nothing or her whole quota: it names bob's own quota, pins and request only."""
    refusals = []
    for alice_pins in (0, 8):
        (tmp_path / f"alice-{alice_pins}").mkdir()
        with _daemon(tmp_path / f"alice-{alice_pins}", {}) as d, \
                Client(d.addr, token="alice-secret") as alice, Client(d.addr, token="bob-secret") as bob:
            for k in _put(alice, "alice", range(alice_pins)):
                alice.pin(k, 600, hard=True)
            _, exc = _pin_until_refused(bob, _put(bob, "bob", range(12)))
            refusals.append((str(exc), exc.requested, exc.free, exc.largest_free))
    assert refusals[0] == refusals[1]
    assert "alice" not in refusals[0][0] and "'bob'" in refusals[0][0]


def test_a_reload_applies_new_pin_bytes(tmp_path):
    with _daemon(tmp_path, {"alice": "512KiB"}) as d, Client(d.addr, token="alice-secret") as alice:
        keys = _put(alice, "alice", range(4))
        pinned, _ = _pin_until_refused(alice, keys)
        assert pinned == 2
        d.write_config(dram=DRAM, max_block="1MiB", sections={"auth": _tenants({"alice": "1MiB"})})
        d.send(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload: applied auth.tenants" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        for k in keys[2:]:
            assert alice.pin(k, 600, hard=True)
