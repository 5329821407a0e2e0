"""`quillctl gateway` against a real gateway in front of real simulated engines: the table and
--json, and a clear exit code when the gateway cannot be reached."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path

from quillcache_cli import exitcodes
from tests._support.gateway import free_port, harness, wait_until

QUILLCTL = str(Path(sys.executable).with_name("quillctl"))


def quillctl(*args):
    return subprocess.run([QUILLCTL, *args], capture_output=True, text=True, timeout=60)


def test_quillctl_gateway_shows_workers_as_a_table_and_as_json():
    async def main():
        loop = asyncio.get_running_loop()
        async with harness(n=2) as h:
            st, _, _ = await h.complete("the quick brown fox jumps over the lazy dog " * 4)
            assert st == 200
            await h.wait_idle()
            # the engines said their KV memory (4,096 pages of 16 tokens each)
            await wait_until(lambda: h.gw.router.models["m"].router.config.kv_blocks == 4096, 10, "KV learned")
            text = await loop.run_in_executor(None, quillctl, "gateway", "--url", h.admin)
            doc = await loop.run_in_executor(None, quillctl, "--json", "gateway", "--url", h.admin)
            return text, doc
    text, doc = asyncio.run(main())
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split()[:5] == ["WORKER", "MODEL", "ROLE", "FROM", "HEALTHY"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"e0", "e1"} and rows["e0"][1:5] == ["m", "both", "config", "yes"]
    assert sum(int(r[6]) for r in rows.values()) == 1                 # ROUTED: the one request
    assert lines[0].split()[10] == "KV_PAGES"
    assert {r[10] for r in rows.values()} == {"0/4096"}                # none held now, of the engine's
    assert doc.returncode == 0, doc.stderr
    workers = {w["id"]: w for w in json.loads(doc.stdout)["workers"]}
    assert sum(w["routed"] for w in workers.values()) == 1
    assert all(w["events"]["lost"] == 0 for w in workers.values())


def test_quillctl_gateway_says_when_the_gateway_cannot_be_reached():
    r = quillctl("gateway", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == exitcodes.UNAVAILABLE and "cannot reach the gateway" in r.stderr
