"""docs/engines.md as an operator reads it: every configuration block goes through the settings
table of the connector it configures (no unknown key, no bad value), each engine has exactly one
copy-paste command line, and the node configuration it shows loads with the node's own parser.
(The engines themselves run these blocks in test_vllm.py, test_sglang.py and test_lmcache.py.)"""
from __future__ import annotations

import re

import pytest
import yaml

from quillcache.connectors import settings
from quillcache.node.settings import load_config
from quillcache.settings.convert import hash_token
from tests._support import engines_doc


def test_every_vllm_json_of_the_doc_passes_the_connectors_settings_table():
    found = engines_doc.doc_json("quillcache.connectors.vllm")
    assert len(found) == 2                              # the command line and the readable block
    assert found[0] == found[1]
    for j in found:
        assert j["kv_connector"] == "QuillCacheConnector" and j["kv_role"] == "kv_both"
        values, unknown = settings.parse(settings.VLLM, j["kv_connector_extra_config"], "doc")
        assert unknown == []
        assert values["address"] == engines_doc.DOC_ADDRESS and values["token_file"] == engines_doc.DOC_TOKEN_FILE


def test_every_sglang_json_of_the_doc_passes_the_backends_settings_table():
    found = engines_doc.doc_json("quillcache.connectors.sglang")
    assert len(found) == 2 and found[0] == found[1]
    for j in found:
        values, unknown = settings.parse(settings.SGLANG, j, "doc", settings.SGLANG_OWN)
        assert unknown == []
        assert (j["backend_name"], j["class_name"], j["interface_v1"]) == ("quillcache", "QuillCacheStorage", 1)
        assert values["address"] == engines_doc.DOC_ADDRESS and values["token_file"] == engines_doc.DOC_TOKEN_FILE


def test_the_lmcache_yaml_passes_the_plugins_settings_table():
    doc = yaml.safe_load(engines_doc.lmcache_yaml())
    assert doc["remote_url"] == "plugin://quillcache" and doc["remote_storage_plugins"] == ["quillcache"]
    prefix = "remote_storage_plugin.quillcache."
    mine = {k[len(prefix):]: v for k, v in doc["extra_config"].items() if k.startswith(prefix)}
    assert len(mine) == len(doc["extra_config"])
    values, unknown = settings.parse(settings.LMCACHE, mine, "doc", settings.LMCACHE_OWN)
    assert unknown == []
    assert mine["module_path"] == "quillcache.connectors.lmcache"
    assert mine["class_name"] == "QuillCacheRemoteConnector"
    assert values["address"] == engines_doc.DOC_ADDRESS and values["token_file"] == engines_doc.DOC_TOKEN_FILE


def test_each_engine_has_one_complete_command_line():
    vllm = engines_doc.engine_command("vllm")
    assert vllm[:2] == ["vllm", "serve"] and "--kv-transfer-config" in vllm
    sgl = engines_doc.engine_command("sglang")
    assert sgl[:3] == ["python", "-m", "sglang.launch_server"]
    for flag in ("--model-path", "--enable-hierarchical-cache", "--hicache-storage-backend-extra-config"):
        assert flag in sgl
    assert sgl[sgl.index("--hicache-storage-backend") + 1] == "dynamic"
    lmc = engines_doc.engine_command("lmcache")
    assert lmc[0] == "LMCACHE_CONFIG_FILE=/etc/quillcache/lmcache.yaml" and lmc[1:3] == ["vllm", "serve"]
    (flag, j), = engines_doc.command_json(lmc)
    assert j == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    text = engines_doc.DOC.read_text()
    assert "Save this as `/etc/quillcache/lmcache.yaml`" in text


def test_the_install_line_puts_the_wheel_into_the_engines_environment():
    cmds = [" ".join(c) for c in engines_doc.commands()]
    assert any(c.startswith(".venv/bin/pip wheel --no-deps --no-build-isolation -w dist .") for c in cmds)
    assert any(re.match(r"/path/to/engine-venv/bin/pip install dist/quillcache-0\.1\.0-\*\.whl$", c) for c in cmds)


def test_the_node_config_of_the_doc_loads_with_the_nodes_parser(tmp_path):
    (block,) = [b for b in engines_doc.blocks("toml") if "[[auth.tenants]]" in b]
    text = re.sub(r'"sha256:<[^>]*>"', f'"{hash_token("engine-secret")}"', block)
    cfg = load_config(text=text, source="docs/engines.md")
    tenant, = cfg.auth.tenants
    assert (tenant.name, tenant.token, tenant.shm, tenant.may_act_for) == (
        "engines", hash_token("engine-secret"), True, ("*",))
    assert cfg.node.shm is True


@pytest.mark.parametrize("table", [settings.VLLM, settings.SGLANG, settings.LMCACHE])
def test_a_bad_value_names_the_setting_and_a_typo_is_reported(table):
    with pytest.raises(settings.SettingError, match=r"where: timeout_s = 'soon': not a number of seconds"):
        settings.parse(table, {"timeout_s": "soon"}, "where")
    with pytest.raises(settings.SettingError, match="token and token_file are both set"):
        settings.parse(table, {"token": "a", "token_file": "/f"}, "where")
    _, unknown = settings.parse(table, {"adress": "127.0.0.1:7470"}, "where")
    assert unknown == ["adress"]
    for bad in (-1, 10_001, "soon", True):
        with pytest.raises(settings.SettingError, match="where: spin_us = "):
            settings.parse(table, {"spin_us": bad}, "where")
    assert settings.parse(table, {}, "where")[0]["spin_us"] == 100.0
    assert settings.parse(table, {"spin_us": "0"}, "where")[0]["spin_us"] == 0.0


def test_a_token_file_is_read_once_stripped_and_a_missing_one_is_a_clear_error(tmp_path):
    f = tmp_path / "t"
    f.write_text("secret\n")
    values, _ = settings.parse(settings.VLLM, {"token_file": str(f)}, "cfg")
    assert settings.resolve_token(values, "cfg") == "secret"
    with pytest.raises(settings.SettingError, match=r"cfg: token_file '/nonexistent/t': No such file"):
        settings.resolve_token({"token_file": "/nonexistent/t"}, "cfg")
    f.write_text("\n")
    with pytest.raises(settings.SettingError, match="is empty"):
        settings.resolve_token({"token_file": str(f)}, "cfg")
