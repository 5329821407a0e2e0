"""connectors/sim.py: the simulated engine's pool on a real node.  Two SimEngines share one
quillcached (with auth on, the engine's tenant acting for the request's): what the first one
computes is stored on the node, the second one loads it from there instead of computing it,
another tenant does not, and a node that is gone is a pool miss, never an engine error."""
from __future__ import annotations

import time

import pytest

from quillcache import Client
from quillcache.connectors.sim import NodePool
from quillcache.control.model import CostModel
from quillcache.control.sim.engine import EngineConfig, SimEngine, SimRequest, chain_hashes
from quillcache.model import IdentityScope
from tests._support.engine_node import EngineNode

A = IdentityScope("m", "tok", None, "tenant-a")
B = IdentityScope("m", "tok", None, "tenant-b")
BS = 4
CFG = EngineConfig(block_size=BS, capacity_blocks=64, max_num_seqs=8, max_batched_tokens=1024,
                   cost=CostModel(prefill_us_per_token=1000, decode_us_per_token=1000, running_decode_penalty_us=0,
                                  cpu_dram_us_per_mb=50), kv_bytes_per_token=1 << 18)


def request(rid, scope, blocks):
    content = [b.to_bytes(4, "big") for b in blocks]
    return SimRequest(rid, scope, len(blocks) * BS + 1, chain_hashes(scope, content), 1, 0,
                      block_tokens=lambda i: [blocks[i]] * BS)


def run(engine, now=0):
    while True:
        plan = engine.plan_step(now, None)
        if plan is None:
            return now
        now = engine.finish_step().end_us


@pytest.fixture
def node(tmp_path):
    with EngineNode(tmp_path) as d:
        yield d


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_a_prefix_one_engine_computed_is_loaded_from_the_node_by_the_other(node, via):
    pools = [NodePool(node.addresses[via], token=node.token, block_size=BS) for _ in range(2)]
    try:
        writer, reader = SimEngine(CFG, pools[0]), SimEngine(CFG, pools[1])
        writer.submit(request("w", A, [1, 2, 3]))
        run(writer)
        deadline = time.monotonic() + 10
        while pools[0].stats()["saved_blocks"] < 3 and time.monotonic() < deadline:   # offer does not wait
            time.sleep(0.02)
        assert pools[0].stats()["saved_blocks"] == 3
        r, other = request("r", A, [1, 2, 3]), request("o", B, [1, 2, 3])
        reader.submit(r)
        run(reader)
        assert r.pool_blocks == 3 and r.hit_blocks == 0
        reader.submit(other)
        run(reader, r.finish_us)
        assert other.pool_blocks == 0                       # another tenant's identity: computed
        assert pools[1].stats()["hit_blocks"] == 3 and pools[1].stats()["connect_errors"] == 0
        with Client(node.addr, token=node.token) as c:
            assert len(c.ls(A)) == 3
    finally:
        for p in pools:
            p.close()


def test_a_node_that_is_gone_is_a_pool_miss_not_an_engine_error(node):
    pool = NodePool(node.addr, token=node.token, block_size=BS, timeout=1.0)
    try:
        node.stop()
        engine = SimEngine(CFG, pool)
        r = request("r", A, [7, 8])
        engine.submit(r)
        run(engine)
        assert r.pool_blocks == 0 and r.finish_us is not None
        assert pool.stats()["lookup_errors"] == 1             # the lookup on the lost connection
        deadline = time.monotonic() + 10
        while pool.stats()["save_errors"] < 1 and time.monotonic() < deadline:    # the offer: async
            time.sleep(0.02)
        assert pool.stats()["save_errors"] == 1 and pool.stats()["connect_errors"] >= 1
    finally:
        pool.close()
