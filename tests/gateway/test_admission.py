"""Admission at the gateway ([router] admission = "predict"): a real quillcache-gateway process
in front of a real quillcache-sim-engine; a request predicted to miss admission_k x [gateway]
slo_ttft is answered 429 with Retry-After and no engine sees it."""
import json
import math

import pytest

from quillcache.control.router import Router, RouterConfig
from quillcache.model import IdentityScope
from quillcache.node.settings import ConfigError
from quillcache.gateway.settings import load_gateway_config
from tests._support.gateway_proc import GatewayProcess

PROMPT_CHARS = 100_000          # approximate mode: one token per character, ~2.9 s of modelled prefill
SLO = "1ms"
ENGINE_ARGS = ("--max-model-len", "131072", "--capacity-blocks", "16384")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _predicted_us(n_tokens: int) -> float:
    """What the gateway's router predicts for the request on an idle engine (the same policy
    code and default cost model: no queue, no credit)."""
    r = Router(RouterConfig(policy="quillcache"), workers=["e0"])
    d = r.route(IdentityScope("m", "m", None, "alice"), token_ids=list(range(n_tokens)), track=False)
    return d.predicted_ttft_us


@pytest.mark.parametrize("admission", ["predict", "off"])
def test_a_request_predicted_to_miss_the_slo_gets_429_and_retry_after_and_reaches_no_engine(tmp_path, admission):
    prompt = "x" * PROMPT_CHARS
    with GatewayProcess(tmp_path, gateway_toml=f'slo_ttft = "{SLO}"', time_scale=0.001, engine_args=ENGINE_ARGS,
                        router_toml=f'policy = "quillcache"\nadmission = "{admission}"\nadmission_k = 1.0') as gp:
        status, headers, body = gp.complete(prompt)
        stats = gp.engine_stats(0)
        metrics = gp.get("/metrics", admin=True)[2].decode()
        if admission == "off":
            assert status == 200, body
            assert stats["prompt_tokens"] == PROMPT_CHARS
            assert _metric(metrics, "quillcache_gateway_admission_refused_total") == 0
            return
        assert status == 429, body
        err = json.loads(body)["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == 429
        assert "admission_k x [gateway] slo_ttft" in err["message"]
        expected = max(1, math.ceil(_predicted_us(PROMPT_CHARS) / 1e6 - 0.001))
        assert expected >= 2                                   # the excess, not the floor of 1 s
        assert headers["Retry-After"] == str(expected)
        assert not any(k.lower().startswith("x-quillcache-") for k in headers)   # no decision to report
        assert stats["prompt_tokens"] == 0 and stats["steps"] == 0            # no engine saw it
        assert _metric(metrics, "quillcache_gateway_admission_refused_total") == 1
        assert 'quillcache_gateway_requests_total{endpoint="completions",status="429"} 1.0' in metrics
        assert _metric(metrics, "quillcache_gateway_rejected_total") == 0    # not the queue limit
        # The refusal left nothing on the engine's books: no load, nothing routed or in flight.
        (worker,) = json.loads(gp.get("/quillcache/workers", admin=True)[2])["workers"]
        assert (worker["routed"], worker["in_flight"], worker["active_prefill_tokens"], worker["prefilled_tokens"],
                worker["active_requests"]) == (0, 0, 0, 0, 0)
        # The SLO is the gateway's slo_ttft (1 ms), not the router's default 800 ms: a prompt
        # predicted at 29 ms is refused, with the floor of Retry-After.
        status, headers, _ = gp.complete("y" * 1000)
        assert 1e3 < _predicted_us(1000) < 800e3
        assert (status, headers["Retry-After"]) == (429, "1")
        # It is the prediction that refuses, not the setting: a 5-token prompt (145 us of
        # modelled prefill, under the 1 ms objective) is served.
        assert gp.complete("short")[0] == 200
        assert gp.engine_stats(0)["prompt_tokens"] == len("short")


def test_admission_needs_the_predicting_policy():
    with pytest.raises(ConfigError, match='admission = "predict" with policy = "dynamo"'):
        load_gateway_config(text='[router]\npolicy = "dynamo"\nadmission = "predict"\n')
    cfg = load_gateway_config(text='[router]\nadmission = "predict"\nadmission_k = 2.5\n'
                                   '[gateway]\nslo_ttft = "300ms"\n')
    assert (cfg.router.admission, cfg.router.admission_k, cfg.gateway.slo_ttft) == ("predict", 2.5, 0.3)


def test_sighup_applies_a_new_slo_ttft_to_admission(tmp_path):
    import signal
    import time

    prompt = "y" * 1000                                         # ~29 ms of modelled prefill
    router = 'policy = "quillcache"\nadmission = "predict"'
    with GatewayProcess(tmp_path, gateway_toml='slo_ttft = "800ms"', router_toml=router, time_scale=0.001) as gp:
        assert gp.complete(prompt)[0] == 200
        gp.write_config(f'slo_ttft = "{SLO}"')
        gp.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reloaded " not in gp.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "gateway.slo_ttft" in gp.log().split("reloaded ", 1)[1]
        status, headers, _ = gp.complete("w" * 1000)          # not the cached prefix: no credit
        assert (status, headers.get("Retry-After")) == (429, "1")
