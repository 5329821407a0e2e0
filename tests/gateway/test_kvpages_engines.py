"""The KV memory a real vLLM says on its /metrics, read as the gateway reads it
([router] learn_kv_blocks): vLLM's own CacheConfig and its own PrometheusStatLogger code write
the info gauge (run in the engines venv, with vLLM 0.33.0 on CPU)."""
from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.engines

prometheus_client = pytest.importorskip("prometheus_client")
vllm_config = pytest.importorskip("vllm.config")
vllm_loggers = pytest.importorskip("vllm.v1.metrics.loggers")

from quillcache.gateway.kvpages import kv_tokens_from_vllm_metrics  # noqa: E402


def _metrics_text(num_gpu_blocks, block_size: int, engines: list[int]) -> str:
    """vLLM's cache_config_info as its PrometheusStatLogger.log_metrics_info writes it, one
    sample per data-parallel engine, into a registry of its own."""
    cache = vllm_config.CacheConfig(block_size=block_size)
    cache.num_gpu_blocks = num_gpu_blocks
    reg = prometheus_client.CollectorRegistry()
    logger = types.SimpleNamespace(engine_indexes=engines,
                                   _gauge_cls=lambda **kw: prometheus_client.Gauge(registry=reg, **kw))
    vllm_loggers.PrometheusStatLogger.log_metrics_info(logger, "cache_config", cache)
    return prometheus_client.generate_latest(reg).decode()


def test_the_kv_tokens_a_real_vllm_cache_config_says_on_its_metrics():
    text = _metrics_text(1234, 16, [0, 1])
    assert text.count("vllm:cache_config_info{") == 2
    assert kv_tokens_from_vllm_metrics(text) == 1234 * 16
    assert kv_tokens_from_vllm_metrics(_metrics_text(5000, 32, [0])) == 5000 * 32
    # before the engine has profiled its memory: num_gpu_blocks is None, nothing is said
    assert kv_tokens_from_vllm_metrics(_metrics_text(None, 16, [0])) is None
