"""A node with auth on, configured the way docs/engines.md tells an operator to: one tenant for
the engine (its token in a file, ``shm = true``, ``may_act_for = ["*"]``), for the connector tests.

    with EngineNode(tmp_path) as n:
        n.addresses["unix"], n.addresses["tcp"], n.token_file, n.wrong_token_file
"""
from __future__ import annotations

from pathlib import Path

from quillcache.settings.convert import hash_token
from tests._support.daemon import Daemon

ENGINE_TENANT = "vllm-pool-a"
ENGINE_TOKEN = "engine-secret-token"


def engine_tenant_toml(token: str = ENGINE_TOKEN, name: str = ENGINE_TENANT) -> str:
    return (f'[[auth.tenants]]\nname = "{name}"\ntoken = "{hash_token(token)}"\nshm = true\n'
            'may_act_for = ["*"]\n')


class EngineNode(Daemon):
    """A Daemon with [[auth.tenants]] for one engine; its token and a wrong one in files."""

    def __init__(self, tmp_path: Path, *, tenants_toml: str | None = None, **kw) -> None:
        super().__init__(tmp_path, sections={"auth": tenants_toml or engine_tenant_toml()}, **kw)
        self.token = ENGINE_TOKEN
        self.token_file = self.tmp / "engine.token"
        self.token_file.write_text(ENGINE_TOKEN + "\n")
        self.wrong_token_file = self.tmp / "wrong.token"
        self.wrong_token_file.write_text("not-the-token\n")

    @property
    def unix(self) -> str:
        return f"unix:{self.data_dir / 'quillcached.sock'}"

    @property
    def addresses(self) -> dict[str, str]:
        return {"tcp": self.addr, "unix": self.unix}
