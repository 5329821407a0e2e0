"""`quillctl engine register`: keep an engine (vLLM, SGLang, ...) registered in etcd, so that
the gateways with [cluster] enabled route to it (cluster/engines.py does the work)."""
import signal
import sys
import threading

import click

from quillcache_cli import exitcodes
from quillcache_cli.ctl_data import fail
from quillcache_cli.params import CREDENTIAL_HELP, registrant_keys


@click.group("engine")
def engine_group():
    """Engines in the cluster's etcd, for the gateways."""


@engine_group.command("register")
@click.option("--etcd", "etcd", multiple=True, default=("127.0.0.1:2379",), show_default=True,
              help="etcd endpoint HOST:PORT (repeatable).")
@click.option("--cluster-id", default="quillcache", show_default=True,
              help="The cluster: the gateways' [cluster] cluster_id.")
@click.option("--id", "engine_id", required=True, help="The engine's id in the gateways (1-64 of A-Z a-z 0-9 _ . -).")
@click.option("--url", required=True, help="Base URL of its OpenAI API, as the gateways reach it.")
@click.option("--model", required=True, help="The served (base) model name.")
@click.option("--tokenizer", default="", help="Path of the model's tokenizer.json on the gateways' hosts.")
@click.option("--tokenizer-id", default="", help="Identity of the tokenizer (default: the model name).")
@click.option("--chat-template", default="", help="Path of a Jinja chat template on the gateways' hosts.")
@click.option("--adapter", "adapters", multiple=True, help="A LoRA adapter it serves (repeatable).")
@click.option("--role", type=click.Choice(["both", "prefill", "decode"]), default="both", show_default=True,
              help="prefill or decode: one side of disaggregated serving.")
@click.option("--kv-events", default="", help="ZMQ endpoint of its KV-event publisher (tcp://host:port).")
@click.option("--kv-replay", default="", help="ZMQ endpoint of its KV-event replay socket.")
@click.option("--block-size", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Tokens per KV block (the engine's page size).")
@click.option("--lease-ttl", default="5s", show_default=True,
              help="TTL of the etcd lease: an engine whose registrant dies leaves the gateways within it.")
@click.option("--health-interval", type=click.FloatRange(min=0.0), default=2.0, show_default=True,
              help="Seconds between GET <url>/health checks: registered once it answers 200, withdrawn "
                   "after 2 failures in a row (0: no checks, registered at once).")
@click.option("--credential-file", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help=CREDENTIAL_HELP)
def register_cmd(etcd, cluster_id, engine_id, url, model, tokenizer, tokenizer_id, chat_template, adapters,
                 role, kv_events, kv_replay, block_size, lease_ttl, health_interval, credential_file):
    """Keep an engine registered until SIGTERM or SIGINT (then withdraw it).

    Run it beside the engine (a systemd unit bound to the engine's, or a sidecar container):
    the record sits on an etcd lease this process keeps alive, so it goes away by itself when
    this process dies.  The record is the gateway's [[gateway.engines]] table, checked here
    the way the gateways check it, and signed with the pool's credential (--credential-file
    or QUILLCACHE_CLUSTER_CREDENTIAL; without one it refuses to start, exit 2)."""
    from quillcache import __version__
    from quillcache.cluster.engines import cluster_args, etcd_client_missing, keep_registered
    from quillcache.net import ConversionError
    from quillcache.gateway.settings import engine_of_record

    record = {"id": engine_id, "url": url, "model": model, "role": role, "block_size": block_size,
              "adapters": list(adapters)}
    for key, value in (("tokenizer", tokenizer), ("tokenizer_id", tokenizer_id),
                       ("chat_template", chat_template), ("kv_events", kv_events), ("kv_replay", kv_replay)):
        if value:
            record[key] = value
    try:
        engine_of_record(record, engine_id)
        endpoints, cluster_id, ttl = cluster_args(etcd, cluster_id, lease_ttl)
        keys = registrant_keys(credential_file, cluster_id)
    except ConversionError as exc:
        fail(exitcodes.USAGE, str(exc))
    if etcd_client_missing():
        fail(exitcodes.UNAVAILABLE, etcd_client_missing())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    keep_registered(endpoints=endpoints, cluster_id=cluster_id, record=record, ttl=ttl,
                    health_interval=health_interval, stop=stop, version=__version__, keys=keys,
                    report=lambda line: click.echo(f"quillctl engine register: {line}", err=True))
    sys.exit(exitcodes.OK)
