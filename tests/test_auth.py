"""Tenants, tokens and the failed-HELLO rate limit: the Authenticator alone, then over the
wire against a real quillcached with [auth] tenants."""
from __future__ import annotations

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.auth import FAILED_HELLO_DELAY_MAX_S, FAILED_HELLO_DELAY_S, FAILED_HELLO_WINDOW_S, Authenticator
from quillcache.settings.convert import hash_token
from quillcache.errors import InvalidArgument, NotFound, PermissionDenied
from quillcache.model import encode_key
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from tests._support.daemon import Daemon
from tests._support.data import key
from tests._support.net import raw_connect, read_frames

TENANTS = [("alice", hash_token("alice-secret")), ("bob", hash_token("bob-secret"))]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- Authenticator


def test_token_binds_its_own_tenant_and_wrong_tokens_are_refused():
    auth = Authenticator(TENANTS, 10)
    assert auth.authenticate(b"alice-secret") == "alice"
    assert auth.authenticate(b"bob-secret") == "bob"
    for bad in (b"", b"alice-secre", b"alice-secret\0", b"sha256:" + TENANTS[0][1][7:].encode()):
        with pytest.raises(PermissionDenied):
            auth.authenticate(bad)


def test_open_mode_accepts_any_hello_and_binds_no_tenant():
    auth = Authenticator((), 10)
    assert auth.open_mode and auth.authenticate(b"whatever") == ""


def test_plain_tokens_in_the_table_are_rejected():
    with pytest.raises(InvalidArgument):
        Authenticator([("alice", "alice-secret")], 10)


def test_failed_hellos_are_slowed_per_source_doubling_up_to_the_cap_never_refused():
    clock = FakeClock()
    auth = Authenticator(TENANTS, 3, clock=clock)
    delays = [auth.record_failure("10.0.0.1") for _ in range(12)]
    assert [d for d, _ in delays[:4]] == [FAILED_HELLO_DELAY_S * 2 ** i for i in range(4)]
    assert max(d for d, _ in delays) == FAILED_HELLO_DELAY_MAX_S == delays[-1][0]
    assert [c for _, c in delays[:3]] == [False, False, True]     # the third in a row closes
    assert auth.failures("10.0.0.1") == 12
    assert auth.record_failure("10.0.0.2") == (FAILED_HELLO_DELAY_S, False)   # per source
    assert auth.authenticate(b"alice-secret") == "alice"      # nothing refuses a valid token
    clock.now += FAILED_HELLO_WINDOW_S + 0.1
    assert auth.failures("10.0.0.1") == 0                     # a quiet minute ends the row
    assert auth.record_failure("10.0.0.1") == (FAILED_HELLO_DELAY_S, False)


def test_failures_are_remembered_for_a_bounded_number_of_sources(monkeypatch):
    import quillcache.auth as auth_mod
    monkeypatch.setattr(auth_mod, "MAX_TRACKED_PEERS", 4)
    auth = Authenticator(TENANTS, 3)
    for i in range(10):
        auth.record_failure(f"10.0.0.{i}")
    assert auth.stats()["failing_sources"] == 4
    assert auth.failures("10.0.0.9") == 1 and auth.failures("10.0.0.0") == 0   # the least recent went


def test_reconfigure_replaces_tenants():
    auth = Authenticator(TENANTS, 10)
    auth.configure([("carol", hash_token("c"))], 5)
    assert auth.tenant_names == ["carol"] and auth.max_failed_hellos == 5
    with pytest.raises(PermissionDenied):
        auth.authenticate(b"alice-secret")


# --------------------------------------------------------------------------- over the wire


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tenants = "\n".join(f'[[auth.tenants]]\nname = "{n}"\ntoken = "{h}"' for n, h in TENANTS)
    tenants += f'\n[[auth.tenants]]\nname = "engine"\ntoken = "{hash_token("engine-secret")}"\nmay_act_for = ["*"]'
    d = Daemon(tmp_path_factory.mktemp("auth"), sections={"auth": "max_failed_hellos = 3\n" + tenants})
    # [[auth.tenants]] tables must come after the [auth] keys: write the file by hand
    d.config.write_text(d.config.read_text().replace("[auth]\nmax_failed_hellos = 3\n", "") .replace(
        "[[auth.tenants]]", "[auth]\nmax_failed_hellos = 3\n[[auth.tenants]]", 1))
    d.start()
    yield d
    assert d.stop() == 0


def test_wrong_token_is_refused(daemon):
    with pytest.raises(PermissionDenied):
        Client(daemon.addr, token="not-a-token")
    with Client(daemon.addr, token="alice-secret") as c:
        assert c.tenant == "alice"
        info = c.info()
        assert info["Server"]["mode"] == "auth" and info["Auth"]["connection_tenant"] == "alice"
        assert info["Auth"]["failed_hellos"] >= 1


@pytest.mark.parametrize("opcode", [Opcode.GET, Opcode.PING])
def test_any_request_before_hello_fails_the_connection(daemon, opcode):
    s = raw_connect(daemon.port)
    k = encode_key(key(1, tenant="alice"))
    body = messages.encode_get_request(k) if opcode == Opcode.GET else b""
    s.sendall(encode_frame_header(opcode, 1, header=body) + encode_frame_header(Opcode.PING, 2))
    frames = read_frames(s, 3)
    assert len(frames) == 1                                    # one connection-level error, then EOF
    assert frames[0].request_id == 0 and frames[0].status == PermissionDenied.status
    assert "before HELLO" in messages.decode_error(frames[0].status, frames[0].header).args[0]
    s.close()


def test_other_tenants_key_is_permission_denied_whether_or_not_it_exists(daemon):
    with Client(daemon.addr, token="bob-secret") as bob:
        bob.put(key(1, tenant="bob"), b"bob's block")
    with Client(daemon.addr, token="alice-secret") as alice:
        errors = []
        for k in (key(1, tenant="bob"), key(2, tenant="bob")):     # exists / does not exist
            for call in (alice.get, alice.exists, alice.remove):
                with pytest.raises(PermissionDenied) as ei:
                    call(k)
                errors.append(str(ei.value))
            with pytest.raises(PermissionDenied):
                alice.put(k, b"overwrite?")
        assert errors[:3] == errors[3:]                        # identical answers for both keys
        with pytest.raises(NotFound):
            alice.get(key(1, tenant="alice"))                  # her own namespace is a plain miss
        assert alice.ls(key(1, tenant="alice").scope, "p") == []
        with pytest.raises(PermissionDenied):
            alice.ls(key(1, tenant="bob").scope, "p")
    with Client(daemon.addr, token="bob-secret") as bob:
        assert bob.get(key(1, tenant="bob")) == b"bob's block"


def test_an_engine_principal_with_may_act_for_names_tenants_and_others_still_cannot(daemon):
    with Client(daemon.addr, token="engine-secret") as engine:
        assert engine.tenant == "engine"
        engine.put(key(7, tenant="alice"), b"alice's block via the engine")
        engine.put(key(7, tenant="bob"), b"bob's block via the engine")
        assert engine.get(key(7, tenant="bob")) == b"bob's block via the engine"
    with Client(daemon.addr, token="alice-secret") as alice:
        assert alice.get(key(7, tenant="alice")) == b"alice's block via the engine"
        with pytest.raises(PermissionDenied):
            alice.get(key(7, tenant="bob"))                    # alice still acts only as herself
        with pytest.raises(PermissionDenied):
            alice.put(key(8, tenant="engine"), b"x")


def test_may_act_for_is_validated_and_only_widens_the_named_principal():
    from quillcache.net import ConversionError
    from quillcache.settings.convert import tenants
    h = hash_token("e")
    entries = tenants([{"name": "eng", "token": h, "may_act_for": ["alice"]}, {"name": "alice", "token": h}])
    auth = Authenticator(entries)
    assert auth.may_act_for("eng", "alice") and auth.may_act_for("eng", "eng")
    assert not auth.may_act_for("eng", "bob") and not auth.may_act_for("alice", "eng")
    for bad in ("*", ["bad name!"], [1]):
        with pytest.raises(ConversionError):
            tenants([{"name": "eng", "token": h, "may_act_for": bad}])


def test_failed_hellos_past_the_limit_close_their_connection_and_the_right_token_still_works(tmp_path):
    tenants = "\n".join(f'[[auth.tenants]]\nname = "{n}"\ntoken = "{h}"' for n, h in TENANTS)
    d = Daemon(tmp_path)
    d.config.write_text(d.config.read_text() + "\n[auth]\nmax_failed_hellos = 2\n" + tenants + "\n")
    with d:
        s = raw_connect(d.port)
        hello = encode_frame_header(Opcode.HELLO, 1, header=messages.encode_hello_request(b"guess"))
        s.sendall(hello)
        assert read_frames(s, 1)[0].status == PermissionDenied.status      # the first: the connection stays
        s.sendall(hello)
        frames = read_frames(s, 2)                  # the second reaches the limit: answered, then closed
        assert len(frames) == 1 and frames[0].status == PermissionDenied.status
        s.close()
        with Client(d.addr, token="alice-secret") as c:                   # never a lockout
            assert c.tenant == "alice"
        assert "then closing" in d.log()


def test_open_mode_says_so_in_info(tmp_path):
    with Daemon(tmp_path) as d, Client(d.addr, token="anything") as c:
        info = c.info()
        assert info["Server"]["mode"] == "open"
        assert info["Server"]["mode_note"] == "open mode (no tenants configured)"
        assert info["Auth"]["mode"] == "open"
        assert c.tenant is None
