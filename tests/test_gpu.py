"""quillcache.client.gpu on CPU tensors against a real quillcached (torch CPU; the CUDA path is
measured by bench/gpu_reload.py on a GPU machine)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from quillcache import Client, KvBlockKey  # noqa: E402
from quillcache.client.gpu import ArenaCopier, _runs  # noqa: E402
from tests._support.daemon import Daemon  # noqa: E402

pytestmark = pytest.mark.engines


def key(i: int) -> KvBlockKey:
    return KvBlockKey("m", "tok", None, "", "gpu", f"b{i}", 0, 16)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("gpu")) as d:
        yield d


def test_save_then_load_round_trips_cpu_tensors_through_the_mapping_and_over_tcp(node):
    kv = torch.randn(8, 64, 8, 128, dtype=torch.bfloat16)          # 8 blocks of 128 KiB
    with Client(f"unix:{node.data_dir / 'quillcached.sock'}") as u, Client(node.addr) as t:
        for c, base in ((u, 0), (t, 100)):
            copier = ArenaCopier(c)
            assert copier.stream is None and copier.registered is False
            copier.save([key(base + i) for i in range(8)], list(kv))
            out = torch.zeros_like(kv)
            got = copier.load([key(base + i) for i in range(8)] + [key(999)], list(out) + [torch.zeros(4)])
            assert got == [kv[0].numel() * 2] * 8 + [None]
            assert torch.equal(out, kv)
        assert bytes(t.get(key(3))) == kv[3].contiguous().view(torch.uint8).numpy().tobytes()
        with pytest.raises(Exception, match="contiguous"):
            ArenaCopier(u).save([key(0)], [kv[0].transpose(0, 1)])


def test_adjacent_blocks_coalesce_into_one_copy_and_others_do_not():
    buf = torch.zeros(4096, dtype=torch.uint8)
    parts = list(buf.view(4, 1024))
    runs = _runs([(0, parts[0], 1024), (1024, parts[1], 1024), (4096, parts[2], 1024), (5120, parts[3], 1024)])
    assert [(off, r.numel()) for off, r in runs] == [(0, 2048), (4096, 2048)]
    assert runs[0][1].data_ptr() == buf.data_ptr() and runs[1][1].data_ptr() == parts[2].data_ptr()
    other = torch.zeros(1024, dtype=torch.uint8)                    # adjacent in the arena, not in memory
    assert len(_runs([(0, parts[0], 1024), (1024, other, 1024)])) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_reload.py's machine)")
def test_an_arena_is_unregistered_before_it_is_unmapped_so_later_device_allocations_work(node):
    """A mapping unmapped while still cudaHostRegister-ed leaves its range mapped on the device;
    the next allocation placed there fails with cudaErrorAlreadyMapped (seen on an H100 after a
    client closed).  The registration holds the mapping until it is undone."""
    import gc
    from quillcache.client import gpu
    blocks = torch.full((4, 1 << 20), 7, dtype=torch.uint8, device="cuda")
    for _ in range(3):                                   # each round maps, registers, closes and drops
        with Client(f"unix:{node.data_dir / 'quillcached.sock'}") as u:
            copier = ArenaCopier(u)
            assert copier.registered
            copier.save([key(700 + i) for i in range(4)], list(blocks))
            address = u.arena.address
            assert gpu._REGISTERED[address] is copier._registration
        del copier
        gc.collect()
        assert address not in gpu._REGISTERED
        held = [torch.ones(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
        torch.cuda.synchronize()
        assert all(int(h[-1]) == 1 for h in held)
        del held
        torch.cuda.empty_cache()
