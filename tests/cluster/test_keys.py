"""The keys a pool derives from its credential (cluster/keys.py)."""
import pytest

from quillcache.cluster.keys import ClusterKeys, hkdf_sha256


def test_hkdf_matches_rfc_5869_test_case_1():
    okm = hkdf_sha256(bytes([0x0B] * 22), bytes(range(0xF0, 0xFA)), salt=bytes(range(13)), length=42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_each_purpose_and_each_pool_has_its_own_key():
    k = ClusterKeys("a-credential-of-some-length", "pool")
    t = ("a", 1, "b", 2, bytes(32), bytes(range(32)))
    # a responder's MAC is never an initiator's, and neither is a record signature
    assert k.responder_mac(*t) != k.initiator_mac(*t)
    assert len({k.responder_mac(*t), k.initiator_mac(*t)}) == 2
    assert k.sign_record("/k", b"x") != ClusterKeys("a-credential-of-some-length", "other").sign_record("/k", b"x")
    assert k.responder_mac(*t) != ClusterKeys("another-credential-entirely", "pool").responder_mac(*t)
    # the transcript binds every field: ids, epochs, both nonces
    for i, v in enumerate(("c", 3, "d", 4, bytes([1]) * 32, bytes(32))):
        assert k.responder_mac(*t[:i], v, *t[i + 1:]) != k.responder_mac(*t)
    # fields are length-prefixed: moving a byte from one id to the other changes the MAC
    z = bytes(32)
    assert k.responder_mac("ab", 1, "c", 2, z, z) != k.responder_mac("a", 1, "bc", 2, z, z)


def test_a_record_signature_covers_its_etcd_key_and_content():
    k = ClusterKeys("a-credential-of-some-length", "pool")
    sig = k.sign_record("/quillcache/pool/nodes/a", b'{"node_id":"a"}')
    assert k.record_signed("/quillcache/pool/nodes/a", b'{"node_id":"a"}', sig)
    assert not k.record_signed("/quillcache/pool/nodes/evil", b'{"node_id":"a"}', sig)
    assert not k.record_signed("/quillcache/pool/nodes/a", b'{"node_id":"b"}', sig)
    assert not k.record_signed("/quillcache/pool/nodes/a", b'{"node_id":"a"}', None)
    assert not k.record_signed("/quillcache/pool/nodes/a", b'{"node_id":"a"}', sig[:-1] + "0")


def test_an_empty_credential_derives_nothing():
    with pytest.raises(ValueError, match="empty"):
        ClusterKeys("", "pool")
