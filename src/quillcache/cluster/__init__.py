"""A pool of nodes: membership on etcd, residency sharded by rendezvous (HRW) hashing,
cross-node fetch over a ``transfer.Transport``, replicas, re-announcement.

``hrw``         rendezvous placement (a key's home and its replica order)
``records``     the residency records a home keeps (on the ART index)
``wire``        the node-to-node messages (opcodes 0x40-0x45; docs/cluster.md)
``membership``  the node's record on an etcd lease and its view of the others
``hook``        ``ClusterHook``: what the server calls on a miss, a put, a drop
"""
