"""Importable test support (the asyncpg ``_testbase`` habit): helpers that start real servers
on free loopback ports, build test data and talk raw frames.

Modules, one concern each (add yours beside them, e.g. ``etcd.py``, ``engines.py``):

- ``net``: free loopback ports and raw sockets that read reply frames.
- ``daemon``: ``Daemon``, a quillcached subprocess with its own config and data dir.
- ``data``: deterministic keys and payloads.
- ``metrics``: scraping and summing the Prometheus endpoint.
- ``gateway``: simulated engines and a gateway on free ports, in the test's loop.
- ``etcd``: a real etcd on free loopback ports; ``cluster``: a pool of nodes on it;
  ``netns``: network namespaces joined by veth pairs; ``devcluster``: ``make cluster``.

Test files import from here, never from another test file.
"""
