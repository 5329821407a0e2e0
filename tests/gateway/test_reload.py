"""SIGHUP on a real quillcache-gateway process: the reloadable settings of the file take effect
for the next request, a changed fixed one is logged and kept, a bad file is refused and the
running configuration kept; the process never dies of it."""
from __future__ import annotations

import json
import signal
import time

from tests._support.gateway_proc import GatewayProcess

PROMPT = "x" * 200                     # 200 tokens in approximate mode


def _hup_and_wait(gp: GatewayProcess, marker: str, n: int = 1) -> None:
    gp.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while gp.log().count(marker) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gp.log().count(marker) >= n, gp.log()


def test_sighup_reloads_the_reloadable_settings_and_keeps_the_rest(tmp_path):
    with GatewayProcess(tmp_path, gateway_toml="max_prompt_tokens = 1000") as gp:
        assert gp.complete(PROMPT, "alice")[0] == 200
        assert gp.complete("short", "carol")[0] == 200
        gp.write_config("max_prompt_tokens = 100\nmax_body = \"1MiB\"")
        text = gp.config.read_text()                          # and carol is no longer a tenant
        carol = text.index('[[auth.tenants]]\nname = "carol"')
        gp.config.write_text(text[:carol] + text[text.index("[[gateway.engines]]"):])
        _hup_and_wait(gp, "reloaded ")
        assert gp.complete("short", "carol")[0] == 401
        st, _, body = gp.complete(PROMPT, "alice")
        assert st == 400 and "max_prompt_tokens = 100" in json.loads(body)["error"]["message"]
        assert "gateway.max_body changed: it needs a restart" in gp.log()
        assert "gateway.max_prompt_tokens" in gp.log().split("reloaded ", 1)[1]

        gp.config.write_text(gp.config.read_text().replace("max_prompt_tokens = 100", "max_prompt_tokens = -1"))
        _hup_and_wait(gp, "reload refused")
        assert gp.complete(PROMPT, "alice")[0] == 400            # the running limit (100) holds
        assert gp.complete("short", "alice")[0] == 200
        assert gp.proc.poll() is None
    assert gp.proc.returncode == 0


def test_a_sighup_while_the_gateway_starts_is_applied_after_start_not_fatal(tmp_path):
    """Its port listens before start() returns: a reload sent by whoever found it open
    must not take HUP's default action (exit); it is applied once the gateway is up."""
    gp = GatewayProcess(tmp_path)
    try:
        gp.start(signal_on_listen=signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reloaded " not in gp.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gp.proc.poll() is None, gp.log()
        assert "reloaded " in gp.log()
        assert gp.complete("short", "alice")[0] == 200
    finally:
        assert gp.stop() == 0
