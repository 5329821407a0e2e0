"""The README as a newcomer follows it, against a real node: its Python blocks run as written
(only the node's address is this test's), and the `Using a node` shell lines work in order."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests._support.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def fenced(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def test_the_readme_python_blocks_run_as_written_against_a_node(tmp_path):
    blocks = fenced("python")
    assert len(blocks) == 2
    with Daemon(tmp_path, ssd=True) as d:         # as `make run`'s embedded defaults: an SSD tier
        ns: dict = {}
        for code in blocks:           # the second uses the first one's key, as the README reads
            code = code.replace('"127.0.0.1:7470"', repr(d.addr))
            code = code.replace('"unix:var/quillcached.sock"', repr(f"unix:{d.data_dir / 'quillcached.sock'}"))
            exec(compile(code, "README.md", "exec"), ns)        # the README's own code
        assert ns["n"] == 256 << 10


def test_the_readme_shell_lines_for_one_node_run_in_order(tmp_path):
    (block,) = [b for b in fenced("sh") if "quillctl put --model llama-3-8b" in b]
    bin_dir = Path(sys.executable).parent
    with Daemon(tmp_path, ssd=True) as d:
        env = {**os.environ, "QUILLCACHE_ADDR": d.addr}
        ran = 0
        for line in block.splitlines():
            cmd = line.split("#")[0].strip()
            if not cmd or cmd.startswith("make ") or " bench " in cmd or "config sample" in cmd \
                    or "config check" in cmd or cmd.startswith("curl "):
                continue
            cmd = cmd.replace(".venv/bin/", f"{bin_dir}/")
            r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, timeout=60)
            assert r.returncode == 0, (cmd, r.stderr)
            ran += 1
        assert ran == 6                                  # ping, head, put, get, ls, info
        assert (tmp_path / "back.bin").read_bytes() == (tmp_path / "weights.bin").read_bytes()


def test_put_of_a_missing_file_says_to_create_it(tmp_path):
    quillctl = Path(sys.executable).with_name("quillctl")
    with Daemon(tmp_path) as d:
        r = subprocess.run([str(quillctl), "put", "--addr", d.addr, "--model", "m", "-p", "root", "-b", "b0",
                            "weights.bin"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 74
    assert "cannot read weights.bin: no such file" in r.stderr and "create it first" in r.stderr
