"""A load through PagedKVWorker that fails part way (the node killed with -9 between chunks, or
a located lease that ran out) leaves no block of the request half-written in the engine's caches
and reports every block of the request for recompute.  CPU torch against a real quillcached,
driven in vLLM's call order (start_load_kv, wait_for_layer_load per layer, take_load_errors), on
both load paths: "layered" (layer by layer out of the mapped arena; a batch whose lease is held
is completed, a later one never started) and "staged" (whole blocks through staging)."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")

from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope  # noqa: E402
from quillcache.model import IdentityScope  # noqa: E402
from quillcache.connectors.paged import PagedKVWorker, Transfer  # noqa: E402

LAYERS, BS, KVH, HD = 2, 16, 2, 8
BLOCKS = 160                     # blocks of the request: one chunk each, so the load takes a while
SENTINEL = -7.0                  # what the reader's caches hold before the load


def caches(fill=None, blocks=BLOCKS, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        t = torch.randn(2, blocks, BS, KVH, HD, generator=g) if fill is None else torch.full(
            (2, blocks, BS, KVH, HD), fill)
        out[f"layers.{i}.attn"] = t.to(torch.bfloat16)
    return out


def keys(n: int, tenant: str):
    scope = model_scope("tiny", dtype="bfloat16", block_size=BS, num_layers=LAYERS, layout="vllm-2nbhd")
    return chain_keys(IdentityScope(scope, "tok", None, tenant), [i.to_bytes(4, "big") * 8 for i in range(n)],
                      block_size=BS)


def store(node, ks) -> dict:
    """Save BLOCKS blocks through a writer worker; returns its caches (the expected bytes)."""
    core = ConnectorCore(f"unix:{node.data_dir / 'quillcached.sock'}", timeout=10)
    try:
        w = PagedKVWorker(core)
        kv = caches()
        w.register_kv_caches(kv)
        t = Transfer("W", ks, list(range(BLOCKS)))
        w.wait_for_save([t])
        deadline = time.monotonic() + 60
        while not w.get_finished({"W"}):
            assert time.monotonic() < deadline, "the save never finished"
            time.sleep(0.01)
        assert core.lookup(ks) == BLOCKS
    finally:
        core.close()
    return kv


def block_states(reader_kv: dict, writer_kv: dict) -> list[str]:
    """Per block of the reader: "loaded" (every layer, K and V, equal to the writer's block),
    "untouched" (every element still the sentinel) or "torn" (anything else)."""
    states = []
    for b in range(BLOCKS):
        r = torch.stack([c[:, b] for c in reader_kv.values()])
        w = torch.stack([c[:, b] for c in writer_kv.values()])
        if torch.equal(r, w):
            states.append("loaded")
        elif bool((r == SENTINEL).all()):
            states.append("untouched")
        else:
            states.append("torn")
    return states


def load(worker: PagedKVWorker, kv: dict, ks) -> set:
    worker.start_load_kv([Transfer("R", ks, list(range(BLOCKS)))])
    for name in kv:
        worker.wait_for_layer_load(name)
    return worker.take_load_errors()


@pytest.mark.parametrize("load_path", ["layered", "staged"])
def test_node_killed_mid_load_leaves_no_torn_block_and_the_request_recomputes(tmp_path, load_path):
    node = Daemon(tmp_path).start()
    try:
        ks = keys(BLOCKS, "killed")
        written = store(node, ks)
        core = ConnectorCore(f"unix:{node.data_dir / 'quillcached.sock'}", timeout=10)
        try:
            block = LAYERS * 2 * BS * KVH * HD * 2
            reader = PagedKVWorker(core, staging_bytes=block, load_path=load_path)      # one block per chunk
            kv = caches(SENTINEL)
            reader.register_kv_caches(kv)
            first = next(iter(kv.values()))

            def kill_after_first_block():
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if not bool((first[0, 0] == SENTINEL).all()):         # block 0 landed
                        node.proc.send_signal(signal.SIGKILL)
                        return
                    time.sleep(0.0005)

            killer = threading.Thread(target=kill_after_first_block)
            killer.start()
            errors = load(reader, kv, ks)
            killer.join()
            assert reader.paths_used[load_path] == 1
        finally:
            core.close()
        states = block_states(kv, written)
        assert "torn" not in states
        assert states.count("loaded") >= 1 and states.count("untouched") >= 1, \
            f"the kill did not land mid-load ({states.count('loaded')} of {BLOCKS} loaded)"
        assert errors == set(range(BLOCKS))            # the whole request is recomputed
        assert core.stats()["load_errors"] >= 1
    finally:
        node.stop(signal.SIGKILL)


@pytest.mark.parametrize("load_path", ["layered", "staged"])
def test_lease_run_out_mid_load_writes_nothing_and_the_request_recomputes(tmp_path, load_path):
    # a lease shorter than any GET_LOCATED round trip: the client finds it expired after the copy
    node = Daemon(tmp_path, sections={"store": 'lease = "50us"'}).start()
    try:
        ks = keys(BLOCKS, "expired")
        written = store(node, ks)
        core = ConnectorCore(f"unix:{node.data_dir / 'quillcached.sock'}", timeout=10)
        try:
            reader = PagedKVWorker(core, staging_bytes=8 * LAYERS * 2 * BS * KVH * HD * 2, load_path=load_path)
            kv = caches(SENTINEL)
            reader.register_kv_caches(kv)
            errors = load(reader, kv, ks)
            assert reader.paths_used[load_path] == 1
            stats = core.stats()
        finally:
            core.close()
        assert block_states(kv, written) == ["untouched"] * BLOCKS
        assert errors == set(range(BLOCKS))
        assert stats["load_errors"] >= 1 and stats["loaded_blocks"] == 0
    finally:
        node.stop()
