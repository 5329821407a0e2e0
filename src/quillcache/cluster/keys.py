"""The keys a pool derives from its ``[cluster] credential``, and what each one signs.

The credential itself never leaves the node (docs/security.md).  Two keys are derived from
it with HKDF-SHA256 (RFC 5869), each bound to the pool's ``cluster_id`` and to one purpose,
so that a MAC made for one purpose is never valid for the other, nor in another pool that
happens to share the credential:

* ``auth``: node-to-node login, a challenge and response in both directions
  (``responder_mac`` / ``initiator_mac``, over both nonces and both node ids and epochs);
* ``record``: the signature of a member record in etcd (``sign_record`` /
  ``record_signed``), over the record's etcd key and its content.

A MAC is compared with ``hmac.compare_digest`` (constant time).
"""
from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = ["ClusterKeys", "NONCE_BYTES", "MAC_BYTES", "hkdf_sha256", "macs_equal"]

NONCE_BYTES = 32            # bytes of a login nonce (random, one per side per login)
MAC_BYTES = 32              # HMAC-SHA256
_SALT = b"quillcache cluster credential"
_AUTH_INFO = b"quillcache/1 node login"
_RECORD_INFO = b"quillcache/1 member record"
_RESPONDER = b"responder"
_INITIATOR = b"initiator"
_Q = struct.Struct("<Q")


def hkdf_sha256(secret: bytes, info: bytes, salt: bytes = _SALT, length: int = 32) -> bytes:
    """RFC 5869 extract-then-expand with SHA-256."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes((i,)), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def _text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<H", len(raw)) + raw        # length-prefixed: no two fields run together


class ClusterKeys:
    """The derived keys of one pool; ``credential`` must be non-empty."""

    __slots__ = ("_auth", "_record", "cluster_id")

    def __init__(self, credential: str | bytes, cluster_id: str) -> None:
        secret = credential.encode("utf-8") if isinstance(credential, str) else bytes(credential)
        if not secret:
            raise ValueError("the cluster credential is empty: nothing to derive keys from")
        self.cluster_id = cluster_id
        cid = b"\x00" + cluster_id.encode("utf-8")
        self._auth = hkdf_sha256(secret, _AUTH_INFO + cid)
        self._record = hkdf_sha256(secret, _RECORD_INFO + cid)

    # ------------------------------------------------------------------ login

    @staticmethod
    def _transcript(initiator: str, initiator_epoch: int, responder: str, responder_epoch: int,
                    nonce_i: bytes, nonce_r: bytes) -> bytes:
        return b"".join((_text(initiator), _Q.pack(initiator_epoch), _text(responder),
                         _Q.pack(responder_epoch), nonce_i, nonce_r))

    def responder_mac(self, *transcript) -> bytes:
        """What the node answering a login proves (sent before the initiator proves anything:
        it covers the initiator's fresh nonce, so it cannot be replayed)."""
        return hmac.new(self._auth, _RESPONDER + self._transcript(*transcript), hashlib.sha256).digest()

    def initiator_mac(self, *transcript) -> bytes:
        """What the node that opened the connection proves, once it checked the responder's MAC
        (a different label: a responder's MAC is never an initiator's)."""
        return hmac.new(self._auth, _INITIATOR + self._transcript(*transcript), hashlib.sha256).digest()

    # ------------------------------------------------------------------ member records

    def sign_record(self, etcd_key: str, content: bytes) -> str:
        """The hex HMAC of a record: its etcd key (a record moved under another key does not
        verify) and its content."""
        return hmac.new(self._record, _text(etcd_key) + content, hashlib.sha256).hexdigest()

    def record_signed(self, etcd_key: str, content: bytes, signature: str) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign_record(etcd_key, content),
                                                                  signature)


def macs_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(bytes(a), bytes(b))
