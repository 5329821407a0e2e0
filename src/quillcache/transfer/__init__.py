"""Moving bytes and node-to-node requests between nodes.

``Transport`` is the interface the cluster hook uses; ``TcpTransport`` implements it over
the binary protocol.  An RDMA transport would implement ``fetch`` as reads into
registered buffers and keep ``request`` on TCP.
"""
from quillcache.transfer.base import FetchResult, Peer, Transport
from quillcache.transfer.tcp import TcpTransport

__all__ = ["Transport", "TcpTransport", "Peer", "FetchResult"]
