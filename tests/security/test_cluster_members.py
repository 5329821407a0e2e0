"""Issue 22, item 1: members prove who they are.  Each test replays one probe of an attacker
against real daemons and a real etcd (docs/security.md, "Threats and answers"): whoever can
write to etcd, or reach a node's port, must get neither the cluster credential nor a
tenant's bytes, nor the power to make a reader serve other bytes.
"""
from __future__ import annotations

import time

import pytest

from quillcache import Client
from quillcache._native.crc import crc32c
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.errors import NotFound, PermissionDenied, QuillCacheError
from quillcache.model import encode_key
from quillcache.protocol import cluster as wire
from quillcache.protocol.opcodes import Opcode
from quillcache.settings.convert import hash_token
from tests._support.cluster import (
    CREDENTIAL, Pool, cluster_keys, cluster_view, content, etcd_call, etcd_put, get_retry, key, member,
    node_record,
)
from tests._support.etcd import EtcdServer, etcd_binary
from tests._support.rogue import Rogue

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)")

TTL_S = 2.0
PREFIX = "/quillcache/test/nodes/"
TENANTS = (f'[[auth.tenants]]\nname = "alice"\ntoken = "{hash_token("tok-alice")}"\n'
           f'[[auth.tenants]]\nname = "bob"\ntoken = "{hash_token("tok-bob")}"\n')


@pytest.fixture
def etcd(tmp_path):
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


def _view(addr: str, token=None) -> dict:
    return {m["node_id"]: m for m in cluster_view(addr, token=token)["members"]}


def _homed_at(home: str, nodes: list[str], n: int, tenant: str = "t0", start: int = 0) -> list[int]:
    ring = Ring(nodes)
    return [i for i in range(start, start + 2000) if ring.home(key_hash(encode_key(key(i, tenant)))) == home][:n]


def _with_tenants(pool: Pool) -> None:
    for d in pool.nodes.values():
        d.config.write_text(d.config.read_text() + TENANTS)
        d.stop()
        d.start()
    pool.token = "tok-alice"


# ---------------------------------------------------------------- records in etcd


def test_a_record_an_etcd_writer_makes_up_is_not_dialled_and_learns_no_credential(tmp_path, etcd):
    """Probe: an attacker who can write to etcd registers `evil` at its own address; the
    nodes then sent it HELLO with the credential in clear.  Now the unsigned record is
    refused (nobody dials it) and nothing the listener receives contains the credential."""
    with Rogue() as rogue, Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(2)
        etcd_put(etcd.endpoint, PREFIX + "evil", node_record("evil", rogue.address, 0xE71))
        time.sleep(1.0)                              # the watch has shown it to both nodes
        # blocks whose home would be evil if it were a member: their holders would ANNOUNCE there
        homed = _homed_at("evil", ["node-a", "node-b", "evil"], 20)
        with Client(pool["a"].addr) as a:
            for i in homed:
                a.put(key(i), content(i, 4096))
        time.sleep(1.0)                              # announcements go out within milliseconds
        assert CREDENTIAL.encode() not in bytes(rogue.received)
        assert rogue.connections == 0, f"a node dialled the made-up member {rogue.connections} times"
        with Client(pool["b"].addr) as b:
            for i in homed:
                assert get_retry(b, key(i)) == content(i, 4096)    # the pool works without it
        for letter in "ab":
            assert "evil" not in _view(pool[letter].addr)
            assert pool.info(letter)["Cluster"]["membership_records_refused"] >= 1


def test_a_node_dialling_an_impostor_sends_no_secret_and_does_not_complete_login(tmp_path):
    """The same impostor, reached by a node's own transport (as if its record had got into
    the view): the login stops at the impostor's MAC, which it cannot compute; it sees a
    nonce and a node id, never the credential, and no NODE_PROOF it could replay."""
    import asyncio

    from quillcache.protocol.opcodes import ProtocolLimits
    from quillcache.transfer.base import Peer
    from quillcache.transfer.tcp import TcpTransport

    limits = ProtocolLimits()
    try:
        transport = TcpTransport(cluster_keys(), node_id="node-a", epoch=lambda: 0xA, limits=limits,
                                 max_fetch_bytes=1 << 20)
    except ImportError:                              # a build without node login: its own transport
        transport = TcpTransport(CREDENTIAL, node_id="node-a", limits=limits, max_fetch_bytes=1 << 20)

    async def probe():
        try:
            await transport.request(Peer("evil", rogue.address, 1), Opcode.LOCATE,
                                    wire.encode_locate([encode_key(key(1))], limits), time.monotonic() + 2)
        finally:
            await transport.close()

    with Rogue() as rogue:
        try:
            asyncio.run(probe())
            outcome = None
        except Exception as exc:
            outcome = exc
        time.sleep(0.2)
        assert CREDENTIAL.encode() not in bytes(rogue.received)
        assert isinstance(outcome, PermissionDenied) and "did not prove" in str(outcome), repr(outcome)
        assert Opcode.NODE_PROOF not in rogue.opcodes and Opcode.LOCATE not in rogue.opcodes, rogue.opcodes
        assert transport.stats()["login_failures"] == 1


def test_a_record_under_another_key_claiming_a_members_id_is_refused(tmp_path, etcd):
    """Probe: a record under `evil` whose JSON says "node_id": "node-b" took node-b's place
    in every view until node-b's next refresh.  The node id is the key's now: refused."""
    with Rogue() as rogue, Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(2)
        real = _view(pool["a"].addr)["node-b"]
        etcd_put(etcd.endpoint, PREFIX + "evil", node_record("node-b", rogue.address, 0xBAD))
        time.sleep(1.0)
        for letter in "ab":
            view = _view(pool[letter].addr)
            assert set(view) == {"node-a", "node-b"}
            assert (view["node-b"]["address"], view["node-b"]["epoch"]) == (real["address"], real["epoch"])
            assert pool.info(letter)["Cluster"]["membership_records_refused"] >= 1
        with Client(pool["b"].addr) as b, Client(pool["a"].addr) as a:   # node-b still serves as node-b
            b.put(key(5), content(5, 4096))
            assert get_retry(a, key(5)) == content(5, 4096)
        assert rogue.connections == 0


def test_unsigned_and_forged_records_are_ignored(tmp_path, etcd):
    """Probe: nothing authenticated a record.  Unsigned, signed with another key, or a node's
    genuine record copied under another name: none enters a view."""
    from quillcache.cluster.keys import ClusterKeys

    with Rogue() as rogue, Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(2)
        etcd_put(etcd.endpoint, PREFIX + "unsigned", node_record("unsigned", rogue.address, 1))
        forged = node_record("forged", rogue.address, 2)
        import json
        d = json.loads(forged)
        d["sig"] = ClusterKeys("not-the-credential-at-all", "test").sign_record(PREFIX + "forged", forged)
        etcd_put(etcd.endpoint, PREFIX + "forged", json.dumps(d, sort_keys=True).encode())
        # node-a's genuine, signed record, replayed under another name (its lease and all)
        raw = etcd_call(etcd.endpoint, "/kv/range", {"key": _b64(PREFIX + "node-a")})["kvs"][0]
        import base64
        etcd_put(etcd.endpoint, PREFIX + "copy", base64.b64decode(raw["value"]), int(raw["lease"]))
        time.sleep(1.0)
        for letter in "ab":
            assert set(_view(pool[letter].addr)) == {"node-a", "node-b"}
            assert pool.info(letter)["Cluster"]["membership_records_refused"] >= 3
        assert rogue.connections == 0


def _b64(s: str) -> str:
    import base64
    return base64.b64encode(s.encode()).decode()


# ---------------------------------------------------------------- member connections


def test_a_member_connection_reads_and_writes_no_tenants_block_through_the_tenant_api(tmp_path, etcd):
    """Probe: with the credential, a connection could GET or PUT any tenant's key.  A
    connection logged in as a node may use the node opcodes only; the credential itself is
    no HELLO token any more."""
    with Pool(tmp_path, etcd.endpoint, 1, lease_ttl=f"{TTL_S}s") as pool:
        _with_tenants(pool)
        pool.wait_members(1)
        addr = pool["a"].addr
        secret = content(1, 4096)
        with Client(addr, token="tok-alice") as alice:
            alice.put(key(1, "alice"), secret)
        # the old way in: HELLO with the credential
        try:
            with Client(addr, token=CREDENTIAL) as c:
                with pytest.raises(PermissionDenied):
                    c.get(key(1, "alice"))
        except PermissionDenied:
            pass                                     # refused at HELLO: the credential is no token
        # a proper member login
        with member(addr, "node-x", 7, peer_id="node-a") as m:
            with pytest.raises(PermissionDenied, match="node opcodes only"):
                m.get(key(1, "alice"))
            with pytest.raises(PermissionDenied, match="node opcodes only"):
                m.get_many([key(1, "alice")])
            with pytest.raises(PermissionDenied, match="node opcodes only"):
                m.put(key(1, "alice"), b"x" * 4096)
            with pytest.raises(PermissionDenied, match="node opcodes only"):
                m.exists(key(1, "alice"))
            with pytest.raises(PermissionDenied, match="node opcodes only"):
                m.info()
            # what a member may do: FETCH on a tenant's behalf, checked by the holder as a GET is
            r = m.call(Opcode.FETCH, wire.encode_fetch("bob", [encode_key(key(1, "alice"))], m.limits))
            assert wire.decode_fetch_reply(r.header, m.limits, 0)[1] == [(NotFound.status, 0)]
        with Client(addr, token="tok-alice") as alice:
            assert alice.get(key(1, "alice")) == secret      # nothing was changed
        # the node HELLO marker is no login: the pre-login limits stay (8 KiB of header)
        with Client(addr, token=wire.NODE_HELLO_TOKEN) as c:
            with pytest.raises(QuillCacheError):
                c.call(Opcode.NODE_AUTH, wire.encode_node_auth("x" * 200, 1, "node-a", bytes(32)) + bytes(16 << 10))
            with pytest.raises(QuillCacheError):        # the frame ended the connection: not just refused
                c.call(Opcode.NODE_AUTH, wire.encode_node_auth("x", 1, "node-a", bytes(32)))


def test_a_wrong_proof_closes_the_login_and_grants_nothing(tmp_path, etcd):
    """Someone without the credential completes NODE_AUTH (the node answers first) but its
    NODE_PROOF is refused, the connection closed; a node answers NODE_AUTH only for its own id."""
    with Pool(tmp_path, etcd.endpoint, 1, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(1)
        addr = pool["a"].addr
        with Client(addr, token=wire.NODE_HELLO_TOKEN) as c:
            c.call(Opcode.NODE_AUTH, wire.encode_node_auth("mallory", 1, "node-a", bytes(32)))
            with pytest.raises(PermissionDenied, match="login failed"):
                c.call(Opcode.NODE_PROOF, wire.encode_node_proof(bytes(32)))
            with pytest.raises(QuillCacheError):
                c.call(Opcode.LOCATE, wire.encode_locate([encode_key(key(1))], c.limits))
        with Client(addr, token=wire.NODE_HELLO_TOKEN) as c:
            with pytest.raises(PermissionDenied, match="not 'node-z'"):
                c.call(Opcode.NODE_AUTH, wire.encode_node_auth("mallory", 1, "node-z", bytes(32)))
        with Client(addr, token=wire.NODE_HELLO_TOKEN) as c:     # the marker alone grants nothing
            with pytest.raises(PermissionDenied):
                c.call(Opcode.LOCATE, wire.encode_locate([encode_key(key(1))], c.limits))
        assert pool.info("a")["Cluster"]["logins_refused"] == 2


def test_announce_and_withdraw_may_name_only_the_senders_own_node_and_epoch(tmp_path, etcd):
    """Probe: with the credential, a connection could WITHDRAW the real holder's record at a
    key's home, and ANNOUNCE itself or anyone as the holder.  Both are refused unless they
    name the node and epoch the connection logged in with; the real record stays."""
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(2)
        b_epoch = int(_view(pool["a"].addr)["node-b"]["epoch"], 16)
        homed = _homed_at("node-a", ["node-a", "node-b"], 4)
        with Client(pool["b"].addr) as b:
            for i in homed:
                b.put(key(i), content(i, 4096))
        with Client(pool["a"].addr) as a:
            for i in homed:
                assert get_retry(a, key(i)) == content(i, 4096)
        ekeys = [encode_key(key(i)) for i in homed]
        with member(pool["a"].addr, "node-c", 7, peer_id="node-a") as m:
            with pytest.raises(PermissionDenied, match="logged in as"):
                m.call(Opcode.WITHDRAW, wire.encode_withdraw("node-b", b_epoch, ekeys, m.limits))
            items = [(ek, 4096, 0) for ek in ekeys]
            with pytest.raises(PermissionDenied, match="logged in as"):
                m.call(Opcode.ANNOUNCE, _announce("node-b", b_epoch, items, m.limits))
            with pytest.raises(PermissionDenied, match="logged in as"):      # its own id, another epoch
                m.call(Opcode.ANNOUNCE, _announce("node-c", 8, items, m.limits))
            m.call(Opcode.ANNOUNCE, _announce("node-c", 7, items, m.limits))  # its own: accepted
            found = wire.decode_locate_reply(m.call(Opcode.LOCATE, wire.encode_locate(ekeys, m.limits)).header,
                                             m.limits)
        assert all([h.node_id for h in hs] == ["node-b"] for hs in found), found   # node-c is in no view
        with Client(pool["a"].addr) as a:                   # node-b's records are still at the home
            for i in homed:
                assert a.get(key(i)) == content(i, 4096)
        assert pool.info("a")["Cluster"]["records_refused_sender"] == 3


def _announce(node: str, epoch: int, items, limits) -> bytes:
    try:
        return wire.encode_announce(node, epoch, items, limits)
    except (ValueError, TypeError):                  # a build whose ANNOUNCE carries no CRC
        return wire.encode_announce(node, epoch, [(k, s) for k, s, _ in items], limits)


# ---------------------------------------------------------------- the bytes


def test_a_holder_serving_other_bytes_than_its_writer_stored_is_a_miss_and_is_not_kept(tmp_path, etcd):
    """Probe: the reader checked epoch, size and CRC, all three from the sender.  A member
    gone bad announces itself as a holder of a block (with the CRC its writer recorded,
    which any member can LOCATE) and serves other bytes of that size, with a frame CRC that
    matches them.  The reader checks the writer's CRC: a miss, and no copy is kept."""
    lease = None
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", cache_remote=True) as pool:
        pool.wait_members(2)
        try:
            keys = cluster_keys()
        except ImportError:
            keys = None
        with Rogue(keys, "evil", 0xE1) as rogue:
            lease = int(etcd_call(etcd.endpoint, "/lease/grant", {"TTL": 60})["ID"])
            etcd_put(etcd.endpoint, PREFIX + "evil",
                     node_record("evil", rogue.address, rogue.epoch, lease, signed_for=PREFIX + "evil"), lease)
            pool.wait_members(3)
            (i,) = _homed_at("node-a", ["node-a", "node-b", "evil"], 1)
            k, ek, size = key(i), encode_key(key(i)), 64 << 10
            real, fake = content(i, size), content(i + 1, size)
            with Client(pool["a"].addr) as a:
                a.put(k, real)                       # node-a stores it and records its CRC
            with member(pool["a"].addr, "evil", rogue.epoch, peer_id="node-a") as m:
                deadline = time.monotonic() + 5
                while True:                          # what the home says: holder, size, CRC
                    found = wire.decode_locate_reply(
                        m.call(Opcode.LOCATE, wire.encode_locate([ek], m.limits)).header, m.limits)[0]
                    if found:
                        break
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                crc = getattr(found[0], "crc", crc32c(real))
                assert crc == crc32c(real)
                m.call(Opcode.ANNOUNCE, _announce("evil", rogue.epoch, [(ek, size, crc)], m.limits))
            rogue.serve[ek] = fake
            with Client(pool["a"].addr) as a:
                assert a.remove(k)                   # the only holder left is the rogue
            time.sleep(0.3)                          # node-a's WITHDRAW reaches the home (itself)
            with Client(pool["b"].addr) as b:
                with pytest.raises(NotFound):
                    got = b.get(k)
                    assert got != fake, "the reader served the rogue's bytes"
                assert rogue.fetches >= 1, (rogue.opcodes, rogue.errors)
                time.sleep(0.5)
                assert not b.exists(k)               # cache_remote kept nothing
            assert pool.info("b")["Cluster"]["crc_mismatches"] >= 1
