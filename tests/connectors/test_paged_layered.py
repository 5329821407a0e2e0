"""The layer-pipelined load of connectors/paged.py (issue 26, item 2) on CPU torch against a real
quillcached over its Unix socket (the arena mapped): a load issues its copies in layer order,
``wait_for_layer_load(L)`` returns once layer L's bytes are in the engine's caches while the
copies of the layers after it are still held back, and the request's bytes are bit-exact at
the end, with bf16 and with FP8 (``kv_dtype = "fp8_e4m3"``), equal to what the staged path
(whole blocks through staging) puts there.  Driven in vLLM's call order (start_load_kv,
wait_for_layer_load per layer, wait_for_save, take_load_errors); vllm 0.33.0's
KVConnectorBase_V1 semantics, torch 2.13.0 (CPU)."""
from __future__ import annotations

import random
import threading
import time

import pytest

from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")

from quillcache.client import Client  # noqa: E402
from quillcache.client.gpu import ArenaCopier, GatherPlan  # noqa: E402
from quillcache.client.gpu_dma import CopyPlan, runs_of  # noqa: E402
from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope  # noqa: E402
from quillcache.connectors.kvquant import make_codec  # noqa: E402
from quillcache.connectors.paged import PagedKVWorker, Transfer  # noqa: E402
from quillcache.errors import InvalidArgument  # noqa: E402
from quillcache.model import IdentityScope, KvBlockKey  # noqa: E402

LAYERS, BS, KVH, HD = 4, 16, 2, 8
BLOCKS = 12                      # blocks of the request
CACHE_BLOCKS = 2 * BLOCKS
SENTINEL = -7.0                  # what the reader's caches hold before the load
HELD_S = 0.3                     # how long a test leaves the later layers held back before looking
WAIT_S = 10.0                    # a wait_for_layer_load that takes longer than this is stuck


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("layered"), dram="128MiB") as d:
        yield d


def sock(node) -> str:
    return f"unix:{node.data_dir / 'quillcached.sock'}"


def names() -> list[str]:
    return [f"layers.{i}.attn" for i in range(LAYERS)]


def caches(fill=None, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names():
        t = torch.randn(2, CACHE_BLOCKS, BS, KVH, HD, generator=g) if fill is None else \
            torch.full((2, CACHE_BLOCKS, BS, KVH, HD), fill)
        out[n] = t.to(torch.bfloat16)
    return out


def keys(kv_dtype: str, tag: str) -> list[KvBlockKey]:
    scope = model_scope("tiny", dtype="bfloat16" if kv_dtype == "auto" else kv_dtype, block_size=BS,
                        num_layers=LAYERS, layout="vllm-2nbhd")
    return chain_keys(IdentityScope(scope, "tok", None, tag), [bytes([i + 1]) * 32 for i in range(BLOCKS)],
                      block_size=BS)


def saved(worker: PagedKVWorker, t: Transfer) -> None:
    worker.wait_for_save([t])
    deadline = time.monotonic() + 30
    while not worker.get_finished({t.req_id}):
        assert time.monotonic() < deadline, "the save never finished"
        time.sleep(0.01)


def expected_layers(written: dict, kv_dtype: str) -> list:
    """What each layer of the request's blocks must hold after the load: the writer's blocks,
    or (FP8) their quantize -> dequantize round trip."""
    blocks = torch.stack([c[:, :BLOCKS] for c in written.values()]).permute(2, 0, 1, 3, 4, 5)   # [n, L, 2, ...]
    codec = make_codec(kv_dtype, torch.bfloat16)
    blocks = codec.decode(codec.encode(blocks.contiguous()), tuple(blocks.shape[1:]))
    return [blocks[:, layer].transpose(0, 1) for layer in range(LAYERS)]     # per layer [2, n, ...]


def written_by_a_writer(core: ConnectorCore, kv_dtype: str, ks: list, seed: int = 1) -> tuple:
    """A writer's random caches saved under ``ks`` (blocks 0..), and what each layer of a load
    of them must hold (``expected_layers``)."""
    writer = PagedKVWorker(core, kv_dtype=kv_dtype)
    written = caches(seed=seed)
    writer.register_kv_caches(written)
    saved(writer, Transfer("W", ks, list(range(len(ks)))))
    return writer, expected_layers(written, kv_dtype)


def bits(t):
    return t.contiguous().view(torch.uint16)


class Gate:
    """The worker's layer_gate: layer 0 passes, layer L >= 1 waits until ``open(L)``."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.opened: dict[int, threading.Event] = {layer: threading.Event() for layer in range(LAYERS)}
        self.opened[0].set()

    def __call__(self, req_id: str, layer: int) -> None:
        self.order.append(layer)
        assert self.opened[layer].wait(60), f"layer {layer} never released"

    def open(self, layer: int) -> None:
        self.opened[layer].set()

    def open_all(self) -> None:
        for e in self.opened.values():
            e.set()


def wait_in_thread(worker: PagedKVWorker, name: str) -> float:
    """wait_for_layer_load(name) on another thread; returns its duration, fails if it is stuck."""
    took: list = []
    th = threading.Thread(target=lambda: (t0 := time.perf_counter(), worker.wait_for_layer_load(name),
                                          took.append(time.perf_counter() - t0)))
    th.start()
    th.join(WAIT_S)
    assert not th.is_alive() and took, f"wait_for_layer_load({name}) did not return while later layers were held"
    return took[0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_wait_for_layer_load_returns_for_layer_l_while_later_layers_are_held_back(node, kv_dtype):
    ks = keys(kv_dtype, f"held-{kv_dtype}")
    core = ConnectorCore(sock(node), timeout=10)
    gate = Gate()
    try:
        writer, want = written_by_a_writer(core, kv_dtype, ks)

        block = writer.stored_nbytes
        reader = PagedKVWorker(core, kv_dtype=kv_dtype, staging_bytes=5 * block, layer_gate=gate)   # 3 batches
        kv = caches(SENTINEL)
        reader.register_kv_caches(kv)
        layers = list(kv.values())
        dst = list(range(BLOCKS, 2 * BLOCKS))
        reader.start_load_kv([Transfer("R", ks, dst)])
        for layer, name in enumerate(names()):
            wait_in_thread(reader, name)
            time.sleep(HELD_S)                    # had the job gone on, the next layer would be written by now
            assert torch.equal(bits(layers[layer][:, dst]), bits(want[layer])), f"layer {layer} not bit-exact"
            for later in range(layer + 1, LAYERS):
                assert bool((layers[later][:, dst] == SENTINEL).all()), \
                    f"layer {later} was written before its copies were released"
            if layer + 1 < LAYERS:
                gate.open(layer + 1)
        reader.wait_for_save([])
        assert reader.take_load_errors() == set()
        assert gate.order == list(range(LAYERS))          # issued in layer order, each layer once
        assert reader.paths_used == {"layered": 1, "staged": 0}
        assert all(bool((c[:, :BLOCKS] == SENTINEL).all()) for c in layers)   # nothing outside the request
        reader.shutdown()
        writer.shutdown()
    finally:
        gate.open_all()
        core.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_layered_and_staged_loads_leave_the_same_bits_and_a_miss_is_recomputed(node, kv_dtype):
    ks = keys(kv_dtype, f"same-{kv_dtype}")
    core = ConnectorCore(sock(node), timeout=10)
    try:
        writer, want = written_by_a_writer(core, kv_dtype, ks[:BLOCKS - 3], seed=5)      # the last 3 are misses
        got = {}
        for path in ("layered", "staged"):
            reader = PagedKVWorker(core, kv_dtype=kv_dtype, load_path=path, staging_bytes=4 * writer.stored_nbytes)
            kv = caches(SENTINEL)
            reader.register_kv_caches(kv)
            dst = list(range(BLOCKS, 2 * BLOCKS))
            reader.start_load_kv([Transfer("R", ks, dst)])
            for name in names():
                reader.wait_for_layer_load(name)
            reader.wait_for_save([])
            assert reader.take_load_errors() == set(dst[BLOCKS - 3:]), path
            assert reader.paths_used[path] == 1
            got[path] = [c.clone() for c in kv.values()]
            for layer, c in enumerate(kv.values()):
                assert torch.equal(bits(c[:, dst[:BLOCKS - 3]]), bits(want[layer][:, :BLOCKS - 3])), (path, layer)
                assert bool((c[:, dst[BLOCKS - 3:]] == SENTINEL).all()), (path, layer)
            reader.shutdown()
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got["layered"], got["staged"]))
        writer.shutdown()
    finally:
        core.close()


def test_a_layered_load_over_tcp_falls_back_to_whole_blocks(node):
    """No mapping (TCP): the staged path, the same bytes."""
    ks = keys("auto", "tcp")
    core = ConnectorCore(sock(node), timeout=10)
    tcp = ConnectorCore(node.addr, timeout=10)
    try:
        writer = PagedKVWorker(core)
        written = caches(seed=9)
        writer.register_kv_caches(written)
        saved(writer, Transfer("W", ks, list(range(BLOCKS))))
        reader = PagedKVWorker(tcp)
        kv = caches(SENTINEL)
        reader.register_kv_caches(kv)
        dst = list(range(BLOCKS, 2 * BLOCKS))
        reader.start_load_kv([Transfer("R", ks, dst)])
        reader.wait_for_layer_load(names()[0])
        assert reader.take_load_errors() == set()
        assert reader.paths_used == {"layered": 0, "staged": 1}
        for layer, c in enumerate(kv.values()):
            assert torch.equal(bits(c[:, dst]), bits(written[names()[layer]][:, :BLOCKS])), layer
        reader.shutdown()
        writer.shutdown()
    finally:
        tcp.close()
        core.close()


def test_gather_reads_each_extent_of_the_arena_wherever_it_lies(node):
    """GatherPlan of one part: bytes [off, off + n) per offset of stored values, against the values
    themselves, at alignments from 1 to 4096 bytes."""
    rng = random.Random(4)
    values = [torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
              for i in range(4)]
    ks = [KvBlockKey("gather", "tok", None, "", "", f"v{i}", 0, 1) for i in range(4)]
    with Client(sock(node)) as c:
        assert c.shm
        c.put_many([(k, v.numpy()) for k, v in zip(ks, values)])
        copier = ArenaCopier(c)
        arena = copier.arena_tensor()
        with c.get_many_located(ks) as views:
            bases = [e[0] for e in views.extents]
            for nbytes, align in [(4096, 4096), (24, 8), (6, 2), (7, 1), (64, 64)]:
                picks = [(rng.randrange(4), rng.randrange(0, (65536 - nbytes) // align) * align) for _ in range(9)]
                got = GatherPlan(arena, [bases[v] + at for v, at in picks], [[(0, nbytes)]]).layer(0)[0]
                assert got.shape == (9, nbytes) and got.dtype == torch.uint8
                for row, (v, at) in zip(got, picks):
                    assert torch.equal(row, values[v][at:at + nbytes]), (nbytes, align, v, at)
        with pytest.raises(Exception, match="outside"):
            GatherPlan(arena, [arena.numel() - 8], [[(0, 16)]])


# a value's parts per layer in the plan tests: an 8-byte scale per layer in front, then 4 KiB per layer
LAYER_PARTS = [[(8 * L, 8), (256 + 4096 * L, 4096)] for L in range(15)]


def stored_values(c: Client, tag: str, n: int, seed: int) -> tuple[list, list]:
    """``n`` random 64 KiB values put through ``c`` (mapped), and their keys."""
    assert c.shm
    values = [torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + i))
              for i in range(n)]
    ks = [KvBlockKey(tag, "tok", None, "", "", f"v{i}", 0, 1) for i in range(n)]
    c.put_many([(k, v.numpy()) for k, v in zip(ks, values)])
    return values, ks


def test_a_gather_plan_reads_every_layers_parts_of_a_batch(node):
    """GatherPlan: per layer, each part's bytes of every value in the batch, values anywhere in
    the arena and parts at offsets that do not share the values' alignment (FP8's 8-byte scales
    beside 4 KiB layers), against the values themselves; a part outside the arena is refused."""
    with Client(sock(node)) as c:
        values, ks = stored_values(c, "plan", 5, seed=10)
        arena = ArenaCopier(c).arena_tensor()
        with c.get_many_located(ks) as views:
            order = [3, 0, 4, 1]                   # not the order they were stored in
            plan = GatherPlan(arena, [views.extents[v][0] for v in order], LAYER_PARTS)
            assert (plan.n, plan.layers) == (4, 15)
            for L, parts in enumerate(LAYER_PARTS):
                got = plan.layer(L)
                assert len(got) == 2
                for (at, nbytes), part in zip(parts, got):
                    assert part.shape == (4, nbytes) and part.dtype == torch.uint8
                    for row, v in zip(part, order):
                        assert torch.equal(row, values[v][at:at + nbytes]), (L, at, v)
            with pytest.raises(InvalidArgument, match="outside"):
                GatherPlan(arena, [views.extents[0][0]], [[(arena.numel(), 8)]])
            with pytest.raises(InvalidArgument, match="one positive size"):
                GatherPlan(arena, [views.extents[0][0]], [[(0, 8)], [(8, 16)]])


@pytest.mark.parametrize("layer_copy", ["kernel", "dma"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("group_blocks, gathers", [(BLOCKS, 1), (5, 3), (3, 3)])
def test_layers_after_the_first_are_read_in_groups_not_in_the_batches_they_were_leased_in(
        node, monkeypatch, kv_dtype, group_blocks, gathers, layer_copy):
    """Twelve blocks leased in three batches of four: layer 0 is written batch by batch (each as
    it is leased), and every later layer in groups of LAYER_GROUP_BYTES of one layer (one gather
    per part and one scatter per group: on an H200 the per-batch launches, not the bus, bounded
    the load).  Batches already as large as a group stay as they are.  Every byte is the
    writer's, whatever the grouping."""
    from quillcache.client import gpu as gpu_mod
    from quillcache.client import gpu_dma
    from quillcache.connectors import paged as paged_mod
    plan_class = gpu_mod.GatherPlan if layer_copy == "kernel" else gpu_dma.CopyPlan
    ks = keys(kv_dtype, f"group-{kv_dtype}-{group_blocks}-{layer_copy}")
    core = ConnectorCore(sock(node), timeout=10)
    try:
        writer, want = written_by_a_writer(core, kv_dtype, ks)
        reader_caches = caches(fill=SENTINEL)
        reader = PagedKVWorker(core, kv_dtype=kv_dtype, staging_bytes=4 * writer.stored_nbytes, layer_copy=layer_copy)
        reader.register_kv_caches(reader_caches)
        monkeypatch.setattr(paged_mod, "LAYER_GROUP_BYTES", group_blocks * reader.block_nbytes // LAYERS)
        calls: dict[int, list[int]] = {}
        real_layer = plan_class.layer

        def counted(plan, layer):
            calls.setdefault(layer, []).append(plan.n)
            return real_layer(plan, layer)
        monkeypatch.setattr(plan_class, "layer", counted)
        reader.start_load_kv([Transfer("R", ks, list(range(BLOCKS, 2 * BLOCKS)))])
        reader.wait_for_layer_load(names()[-1])
        assert reader.take_load_errors() == set()
        assert calls[0] == [4, 4, 4]
        sizes = [4, 4, 4] if group_blocks == 3 else [group_blocks] * (BLOCKS // group_blocks) + \
            ([BLOCKS % group_blocks] if BLOCKS % group_blocks else [])
        assert all(calls[layer] == sizes and len(sizes) == gathers for layer in range(1, LAYERS)), calls
        for layer, n in enumerate(names()):
            assert torch.equal(bits(reader_caches[n][:, BLOCKS:]), bits(want[layer])), layer
        reader.shutdown()
        writer.shutdown()
    finally:
        core.close()


def test_runs_of_cuts_offsets_into_pitched_runs():
    """runs_of: rows at one stride (>= the width) are one run; a change of stride, a stride under
    the width (rows would overlap) or a step backwards starts another."""
    assert runs_of([0, 100, 200, 300], 64) == [(0, 4, 0, 100)]
    assert runs_of([0, 100, 200, 500, 600], 64) == [(0, 3, 0, 100), (3, 5, 500, 100)]
    assert runs_of([0, 32, 64], 64) == [(0, 1, 0, 64), (1, 2, 32, 64), (2, 3, 64, 64)]
    assert runs_of([300, 200, 100], 64) == [(0, 1, 300, 64), (1, 2, 200, 64), (2, 3, 100, 64)]
    assert runs_of([7], 8) == [(0, 1, 7, 8)]
    assert runs_of([0, 64, 128, 4096, 8192], 64) == [(0, 3, 0, 64), (3, 5, 4096, 4096)]
    assert runs_of([0, 5000, 10000], 64, max_pitch=4096) == [(0, 1, 0, 64), (1, 2, 5000, 64), (2, 3, 10000, 64)]
    for _ in range(200):                                   # every row is in exactly one run, at its offset
        rng = random.Random(_)
        offs = sorted(rng.sample(range(0, 4096, 8), rng.randrange(1, 30)))
        if rng.random() < 0.3:
            rng.shuffle(offs)
        width = rng.choice([8, 16, 64])
        rows = [(first + i, off + i * stride) for first, end, off, stride in runs_of(offs, width)
                for i in range(end - first)]
        assert rows == list(enumerate(offs))
        assert all(stride >= width for *_, stride in runs_of(offs, width))


def test_a_copy_plan_reads_what_a_gather_plan_reads(node):
    """CopyPlan (the copy engines' pitched copies; on CPU the same runs as strided copies) gives
    every layer's parts of a batch byte for byte as GatherPlan does, for values stored side by
    side, in another order, and with a hole between them; a part outside the arena is refused."""
    with Client(sock(node)) as c:
        values, ks = stored_values(c, "copyplan", 8, seed=30)
        copier = ArenaCopier(c)
        arena, host = copier.arena_tensor(), copier.host_tensor()
        with c.get_many_located(ks) as views:
            for order in ([0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 7, 0, 1, 2], [0, 1, 3, 4, 7], [7, 3]):
                offsets = [views.extents[v][0] for v in order]
                plan = CopyPlan(host, offsets, LAYER_PARTS, "cpu")
                ref = GatherPlan(arena, offsets, LAYER_PARTS)
                assert (plan.n, plan.layers) == (len(order), 15)
                for L, parts in enumerate(LAYER_PARTS):
                    got = plan.layer(L)
                    assert [g.shape for g in got] == [(len(order), 8), (len(order), 4096)]
                    assert all(torch.equal(a, b) for a, b in zip(got, ref.layer(L))), (order, L)
                    for row, v in zip(got[1], order):
                        assert torch.equal(row, values[v][parts[1][0]:parts[1][0] + 4096])
            with pytest.raises(InvalidArgument, match="outside"):
                CopyPlan(host, [views.extents[0][0]], [[(host.numel(), 8)]], "cpu")


def test_two_requests_of_one_step_get_layer_0_before_either_gets_layer_1(node):
    """One step, two loads: layer 0 of both is usable while layer 1 of both is held back; a
    miss in the second request is its own (the first loads in full)."""
    ka, kb = keys("auto", "two-a"), keys("auto", "two-b")
    core = ConnectorCore(sock(node), timeout=10)
    gate = Gate()
    try:
        writer = PagedKVWorker(core)
        written = caches(seed=11)
        writer.register_kv_caches(written)
        half = BLOCKS // 2
        saved(writer, Transfer("WA", ka[:half], list(range(half))))
        saved(writer, Transfer("WB", kb[:half - 2], list(range(half, 2 * half - 2))))     # B: 2 misses at the end
        reader = PagedKVWorker(core, staging_bytes=2 * writer.stored_nbytes, layer_gate=gate)
        kv = caches(SENTINEL)
        reader.register_kv_caches(kv)
        layers = list(kv.values())
        da, db = list(range(BLOCKS, BLOCKS + half)), list(range(BLOCKS + half, 2 * BLOCKS))
        reader.start_load_kv([Transfer("A", ka[:half], da), Transfer("B", kb[:half], db)])
        wait_in_thread(reader, names()[0])
        time.sleep(HELD_S)
        w0 = written[names()[0]]
        assert torch.equal(bits(layers[0][:, da]), bits(w0[:, :half]))
        assert torch.equal(bits(layers[0][:, db[:half - 2]]), bits(w0[:, half:2 * half - 2]))
        assert all(bool((c[:, BLOCKS:] == SENTINEL).all()) for c in layers[1:])
        assert gate.order == [0, 0, 1]              # A's layer 0, B's layer 0, then A's layer 1: held
        gate.open_all()
        for name in names():
            reader.wait_for_layer_load(name)
        reader.wait_for_save([])
        assert reader.take_load_errors() == set(db[half - 2:])
        for layer, c in enumerate(layers):
            w = written[names()[layer]]
            assert torch.equal(bits(c[:, da]), bits(w[:, :half])), layer
            assert torch.equal(bits(c[:, db[:half - 2]]), bits(w[:, half:2 * half - 2])), layer
        assert gate.order == [0, 0] + [layer for layer in range(1, LAYERS) for _ in "AB"]
        reader.shutdown()
        writer.shutdown()
    finally:
        gate.open_all()
        core.close()


@pytest.mark.parametrize("load_path", ["layered", "staged"])
def test_a_request_of_more_small_blocks_than_one_located_get_may_name_loads_in_full(node, load_path):
    """600 blocks of 4 KiB under the default 256 MiB of staging: the located GETs are cut at 256
    keys (more overflow the node's 64 KiB header limit; the staged path once sent them all)."""
    n = 600
    scope = model_scope("tiny", dtype="bfloat16", block_size=BS, num_layers=LAYERS, layout="vllm-2nbhd")
    ks = chain_keys(IdentityScope(scope, "tok", None, f"many-{load_path}"),
                    [i.to_bytes(4, "big") * 8 for i in range(n)], block_size=BS)
    core = ConnectorCore(sock(node), timeout=10)
    try:
        g = torch.Generator().manual_seed(2)
        written = {name: torch.randn(2, 2 * n, BS, KVH, HD, generator=g).to(torch.bfloat16) for name in names()}
        writer = PagedKVWorker(core)
        writer.register_kv_caches(written)
        saved(writer, Transfer("W", ks, list(range(n))))
        reader = PagedKVWorker(core, load_path=load_path)
        reader.register_kv_caches(written)
        reader.start_load_kv([Transfer("R", ks, list(range(n, 2 * n)))])
        for name in names():
            reader.wait_for_layer_load(name)
        assert reader.take_load_errors() == set()
        assert reader.paths_used[load_path] == 1
        for c in written.values():
            assert torch.equal(bits(c[:, n:]), bits(c[:, :n]))
        reader.shutdown()
        writer.shutdown()
    finally:
        core.close()


def test_a_load_that_stops_between_layers_for_another_reason_is_reported_not_counted_loaded(node):
    """An error that is not the node's (here raised by the layer gate before layer 2, as device
    memory running out would be) ends the job: every block of the request is reported for
    recompute, none counted loaded, and the leases are released."""
    ks = keys("auto", "stops")
    core = ConnectorCore(sock(node), timeout=10)

    def gate(req_id, layer):
        if layer == 2:
            raise RuntimeError("no device memory for layer 2")
    try:
        writer = PagedKVWorker(core)
        written = caches(seed=13)
        writer.register_kv_caches(written)
        saved(writer, Transfer("W", ks, list(range(BLOCKS))))
        reader = PagedKVWorker(core, layer_gate=gate)
        reader.register_kv_caches(caches(SENTINEL))
        dst = list(range(BLOCKS, 2 * BLOCKS))
        before = core.stats()["loaded_blocks"]
        reader.start_load_kv([Transfer("R", ks, dst)])
        for name in names():
            reader.wait_for_layer_load(name)
        reader.wait_for_save([])
        assert reader.take_load_errors() == set(dst)
        assert core.stats()["loaded_blocks"] == before
        with Client(sock(node)) as c:           # the leases were released, the blocks are still there
            assert int(c.info("Server")["Server"]["located_leases"]) == 0
            assert c.exists_many(ks)[0] == BLOCKS
        reader.shutdown()
        writer.shutdown()
    finally:
        core.close()
