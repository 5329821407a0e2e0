"""The engines' venv holds the pinned engine versions on a CPU torch, and their KV-cache
interfaces import: what every adapter in quillcache.connectors is built against."""
from __future__ import annotations

import pytest

from tests._support import engines

pytestmark = pytest.mark.engines
torch = engines.require("torch")


def test_torch_is_the_cpu_wheel_never_a_cuda_build():
    assert torch.__version__.startswith(engines.VERSIONS["torch"])
    assert torch.version.cuda is None


@pytest.mark.parametrize("name", ["vllm", "sglang", "lmcache"])
def test_engine_version_is_the_pinned_one(name):
    assert engines.version(name) == engines.VERSIONS[name]


def test_engine_kv_interfaces_import_as_base_classes():
    engines.require("vllm")
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    for cls in (KVConnectorBase_V1, HiCacheStorage, RemoteConnector):
        assert isinstance(cls, type)
    assert {r.name for r in KVConnectorRole} >= {"SCHEDULER", "WORKER"}
