"""The configuration blocks of docs/engines.md, as an operator copies them: the fenced ``json``,
``yaml`` and ``toml`` blocks, and the JSON quoted in each ``sh`` command line.  The tests run
them through the connectors' settings tables and, with the address and the token file swapped
for a test node's, through the engines themselves.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "engines.md"
DOC_ADDRESS = "unix:/run/quillcache/quillcached.sock"
DOC_TOKEN_FILE = "/etc/quillcache/engine.token"
JSON_FLAGS = ("--kv-transfer-config", "--hicache-storage-backend-extra-config")

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str, path: Path = DOC) -> list[str]:
    """The bodies of the fenced blocks of one language, in the doc's order."""
    return [body for kind, body in _FENCE.findall(path.read_text()) if kind == lang]


def commands(path: Path = DOC) -> list[list[str]]:
    """Every command line of the ``sh`` blocks, split as the shell splits it (comments dropped)."""
    out = []
    for body in blocks("sh", path):
        for line in body.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(shlex.split(line, comments=True))
    return out


def command_json(argv: list[str]) -> list[tuple[str, dict]]:
    """(flag, parsed JSON) for each JSON-valued flag of one command line."""
    return [(a, json.loads(argv[i + 1])) for i, a in enumerate(argv[:-1]) if a in JSON_FLAGS]


def engine_command(program: str, path: Path = DOC) -> list[str]:
    """The one command line that starts ``program`` (``vllm`` without LMCache, ``sglang``,
    ``lmcache``: the vllm line with LMCACHE_CONFIG_FILE)."""
    found = []
    for argv in commands(path):
        words = " ".join(argv)
        if program == "lmcache" and argv[0].startswith("LMCACHE_CONFIG_FILE="):
            found.append(argv)
        elif program == "vllm" and argv[0] == "vllm":
            found.append(argv)
        elif program == "sglang" and "sglang.launch_server" in words:
            found.append(argv)
    if len(found) != 1:
        raise AssertionError(f"docs/engines.md: {len(found)} command lines start {program}, expected one")
    return found[0]


def doc_json(module_path: str, path: Path = DOC) -> list[dict]:
    """Every JSON of the doc (readable blocks and command lines) that names ``module_path``."""
    found = [json.loads(b) for b in blocks("json", path)]
    found += [j for argv in commands(path) for _, j in command_json(argv)]
    return [j for j in found if module_path in (j.get("kv_connector_module_path"), j.get("module_path"))]


def for_node(config: dict, address: str, token_file: str) -> dict:
    """A copy of ``config`` (any nesting) with the doc's address and token file replaced."""
    text = json.dumps(config).replace(DOC_ADDRESS, address).replace(DOC_TOKEN_FILE, token_file)
    return json.loads(text)


def lmcache_yaml(path: Path = DOC) -> str:
    found = [b for b in blocks("yaml", path) if "plugin://quillcache" in b]
    if len(found) != 1:
        raise AssertionError(f"docs/engines.md: {len(found)} LMCache YAML blocks, expected one")
    return found[0]
