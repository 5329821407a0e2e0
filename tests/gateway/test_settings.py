import subprocess
import sys

import pytest

from quillcache.node.settings import ConfigError, render_sample
from quillcache.gateway.settings import GATEWAY_REGISTRY, load_gateway_config

ENGINE = '[[gateway.engines]]\nid = "e0"\nurl = "http://127.0.0.1:9000"\nmodel = "m"\n'


def test_engines_parse_with_defaults():
    cfg = load_gateway_config(text=ENGINE + 'adapters = ["sql"]\nkv_events = "tcp://127.0.0.1:5557"\n')
    (e,) = cfg.gateway.engines
    assert (e.id, e.url, e.model, e.adapters, e.role, e.block_size) == ("e0", "http://127.0.0.1:9000", "m",
                                                                        ("sql",), "both", 16)
    assert e.identity_tokenizer == "m"


@pytest.mark.parametrize("extra, message", [
    ('colour = "red"\n', "unknown key 'colour'"),
    ('role = "boss"\n', "role 'boss' is not one of"),
    ('kv_events = "http://x"\n', "is not a ZMQ endpoint"),
    ('kv_replay = "tcp://127.0.0.1:1"\n', "kv_replay needs kv_events"),
    ('block_size = 0\n', "block_size must be an integer"),
    ('adapters = ["m"]\n', "adapter 'm' is also the base model name"),
])
def test_bad_engine_entries_name_file_section_key_and_reason(extra, message):
    with pytest.raises(ConfigError) as exc:
        load_gateway_config(text=ENGINE + extra)
    assert message in str(exc.value)
    assert "quillcache.toml" in str(exc.value)


def test_duplicate_engine_ids_and_bad_urls_are_refused():
    with pytest.raises(ConfigError, match="listed twice"):
        load_gateway_config(text=ENGINE + ENGINE)
    with pytest.raises(ConfigError, match="must be http"):
        load_gateway_config(text=ENGINE.replace("http://127.0.0.1:9000", "ftp://x"))


@pytest.mark.parametrize("extra", ['block_size = 32\n', 'tokenizer = "/tmp/other.json"\n',
                                   'chat_template = "/tmp/t.jinja"\n'])
def test_engines_of_one_model_must_share_tokenizer_and_block_size(extra):
    second = ENGINE.replace('"e0"', '"e1"') + extra
    with pytest.raises(ConfigError, match="differs from engine e0's"):
        load_gateway_config(text=ENGINE + second)
    load_gateway_config(text=ENGINE + ENGINE.replace('"e0"', '"e1"'))      # the same: fine


def test_node_sections_are_unknown_to_the_gateway_and_vice_versa():
    with pytest.raises(ConfigError, match=r"unknown section \[store\]"):
        load_gateway_config(text='[store]\ndram = "1GiB"\n')
    from quillcache.node.settings import load_config
    with pytest.raises(ConfigError, match=r"unknown section \[gateway\]"):
        load_config(text='[gateway]\nlisten = "127.0.0.1:1"\n')


def test_auth_is_the_nodes_own_setting():
    from quillcache.node.settings import SETTINGS
    node_auth = [s for s in SETTINGS if s.section == "auth"]
    assert node_auth and all(any(s is g for g in GATEWAY_REGISTRY.settings) for s in node_auth)


def test_sample_round_trips():
    text = render_sample(GATEWAY_REGISTRY)
    assert "[gateway]" in text and "[store]" not in text
    load_gateway_config(text=text)


def test_cli_bad_config_exits_78(tmp_path):
    bad = tmp_path / "gw.toml"
    bad.write_text('[gateway]\nlisten = "nowhere"\n')
    r = subprocess.run([sys.executable, "-m", "quillcache_cli.quillcache_gateway", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78, r.stderr
    assert "[gateway] listen = \"nowhere\": not a host:port" in r.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    r = subprocess.run([sys.executable, "-m", "quillcache_cli.quillcache_gateway", "--config", str(empty)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "engines is empty" in r.stderr


def test_the_node_and_the_gateway_share_one_engine_spec_and_one_validator():
    from quillcache.control.modules import EngineSpec as NodeSpec
    from quillcache.gateway.settings import EngineSpec as GatewaySpec
    from quillcache.node.settings import load_config
    assert NodeSpec is GatewaySpec
    node = ('[router]\nmodule = "quillcache"\n[[router.engines]]\nid = "e0"\nmodel = "m"\ntokenizer = "t"\n'
            'tenant = "a"\n')
    errors = []
    for load, text in ((load_config, node + 'endpoint = "tcp://h"\n'),
                       (load_gateway_config, ENGINE + 'kv_events = "tcp://h"\n'),
                       (load_config, node.replace('"e0"', '"e 0"') + 'endpoint = "tcp://h:1"\n'),
                       (load_gateway_config, ENGINE.replace('"e0"', '"e 0"'))):
        with pytest.raises(ConfigError) as exc:
            load(text=text)
        errors.append(str(exc.value).split("entry 0: ", 1)[1])
    assert errors[0] == errors[1].replace("kv_events", "endpoint") and "is not a ZMQ endpoint" in errors[0]
    assert errors[2] == errors[3] == "id 'e 0' must be 1-128 of A-Z a-z 0-9 _ . : -"


def test_cluster_enabled_needs_the_pools_credential_and_never_echoes_it():
    cluster = '[cluster]\nenabled = true\netcd = ["127.0.0.1:2379"]\n'
    with pytest.raises(ConfigError, match=r"\[cluster\] credential: needs at least 16 characters"):
        load_gateway_config(text=cluster)
    with pytest.raises(ConfigError) as exc:
        load_gateway_config(text=cluster + 'credential = "sekrit-15-chars"\n')
    assert "sekrit" not in str(exc.value)
    cfg = load_gateway_config(text=cluster + 'credential = "sixteen-chars-ok"\n')
    assert cfg.cluster.credential == "sixteen-chars-ok"
    assert load_gateway_config(text='[cluster]\nenabled = false\n').cluster.credential == ""


@pytest.mark.parametrize("kv_blocks, expected", [("", None), ("kv_blocks = 0\n", None), ("kv_blocks = 40\n", 40)])
def test_router_kv_blocks_reaches_the_gateways_model_routers(kv_blocks, expected):
    """[router] kv_blocks (the engines' KV pages) turns on the predictor's wait-for-pages term
    at the gateway; 0 or absent: not known, the term is off."""
    from quillcache.gateway.routing import GatewayRouter
    cfg = load_gateway_config(text=ENGINE + f'\n[router]\npolicy = "quillcache"\n{kv_blocks}')
    gr = GatewayRouter(cfg)
    for spec in cfg.gateway.engines:
        gr.add_engine(spec)
    (mr,) = gr.models.values()
    assert mr.router.config.kv_blocks == expected


def test_router_kv_blocks_out_of_range_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"\[router\] kv_blocks"):
        load_gateway_config(text=ENGINE + '\n[router]\nkv_blocks = -1\n')
