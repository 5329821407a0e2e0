"""quillcache-sim-engine: a simulated LLM engine for tests and evaluation (a thin front end;
the work is in quillcache.control.sim)."""
import sys

import click
import zmq

from quillcache_cli import exitcodes
from quillcache_cli.params import CREDENTIAL_HELP, registrant_keys


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP listen address.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="HTTP port (0: a free one; the READY line says which).")
@click.option("--kv-events", "events_endpoint", default=None,
              help="ZMQ PUB endpoint for the KV events, e.g. tcp://127.0.0.1:5557 (none: off).")
@click.option("--kv-events-replay", "replay_endpoint", default=None,
              help="ZMQ ROUTER endpoint that replays missed event batches.")
@click.option("--kv-topic", default="", help="Topic frame of every event message.")
@click.option("--model", default="sim-model", show_default=True, help="Served model name.")
@click.option("--adapter", "adapters", multiple=True, help="A served LoRA adapter name (repeatable).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(1),
              help="Tokens per KV block.")
@click.option("--capacity-blocks", default=4096, show_default=True, type=click.IntRange(1),
              help="KV blocks in the cache.")
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(1))
@click.option("--max-batched-tokens", default=2048, show_default=True, type=click.IntRange(1),
              help="Tokens per iteration (chunked-prefill budget).")
@click.option("--max-model-len", default=32768, show_default=True, type=click.IntRange(1))
@click.option("--prefill-us-per-token", type=click.IntRange(0), default=None,
              help="Cost knob (default: the H200 Llama-3-8B model).")
@click.option("--decode-us-per-token", type=click.IntRange(0), default=None,
              help="Cost knob: one decode iteration.")
@click.option("--running-decode-penalty-us", type=click.IntRange(0), default=None,
              help="Cost knob: added per running decode per iteration.")
@click.option("--pool-us-per-mb", type=click.IntRange(0), default=None,
              help="Cost knob: loading a prefix from the pool, per MiB of KV.")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              help="Wall-clock seconds per modelled second (0.01: a hundred times faster than the GPU).")
@click.option("--etcd", "etcd", multiple=True,
              help="Register in etcd at HOST:PORT (repeatable) so gateways with [cluster] enabled "
                   "route to this engine; withdrawn at the stop, gone after --lease-ttl if it dies.")
@click.option("--cluster-id", default="quillcache", show_default=True, help="The cluster to register in.")
@click.option("--engine-id", default="", help="Its id in the gateways (default: sim-<http port>).")
@click.option("--role", type=click.Choice(["both", "prefill", "decode"]), default="both", show_default=True,
              help="Its role in the registration (prefill and decode: disaggregated serving).")
@click.option("--lease-ttl", default="3s", show_default=True, help="TTL of the registration's etcd lease.")
@click.option("--advertise-host", default="",
              help="Host the gateways reach it at, in the registration (default: the bound address).")
@click.option("--credential-file", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="With --etcd: " + CREDENTIAL_HELP)
@click.option("--pool", "pool_addr", default=None, metavar="ADDRESS",
              help="Use a QuillCache node as the shared KV pool (unix:/path or host:port): blocks this "
                   "engine computes are stored there, and a prefix another engine stored is loaded "
                   "(usage.pool_tokens) instead of computed.")
@click.option("--pool-token", envvar="QUILLCACHE_TOKEN", default=None,
              help="Tenant token for the pool node (env QUILLCACHE_TOKEN).")
@click.version_option(package_name="quillcache")
def main(host, port, events_endpoint, replay_endpoint, kv_topic, model, adapters, block_size,
         capacity_blocks, max_num_seqs, max_batched_tokens, max_model_len, prefill_us_per_token,
         decode_us_per_token, running_decode_penalty_us, pool_us_per_mb, time_scale, etcd, cluster_id,
         engine_id, role, lease_ttl, advertise_host, pool_addr, pool_token, credential_file):
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models,
    /health) from a simulated engine: a paged prefix cache keyed by identity, continuous
    batching timed by a cost model, vLLM-format KV events on ZMQ.  Prints one READY line
    with the bound addresses, then serves until SIGINT/SIGTERM.  With --etcd it registers
    itself (cluster/engines.py) once bound, like `quillctl engine register` does for vLLM,
    its record signed with the pool's credential (--credential-file or
    QUILLCACHE_CLUSTER_CREDENTIAL; without one it refuses to start, exit 2)."""
    from quillcache.net import ConversionError
    from quillcache.control.sim.engine import EngineConfig, SimEngineError, cost_with
    from quillcache.control.sim.server import SimServerConfig, serve_forever

    try:
        cost = cost_with(prefill_us_per_token=prefill_us_per_token,
                         decode_us_per_token=decode_us_per_token,
                         running_decode_penalty_us=running_decode_penalty_us,
                         cpu_dram_us_per_mb=pool_us_per_mb)
        engine = EngineConfig(block_size=block_size, capacity_blocks=capacity_blocks,
                              max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                              cost=cost)
    except SimEngineError as exc:
        click.echo(f"quillcache-sim-engine: {exc}", err=True)
        sys.exit(exitcodes.CONFIG)
    pool = None
    if pool_addr:
        from quillcache.client.calls import resolve_address
        from quillcache.connectors.sim import NodePool
        from quillcache.errors import InvalidArgument
        try:
            resolve_address(pool_addr)
        except InvalidArgument as exc:
            raise click.BadParameter(str(exc), param_hint="--pool") from None
        pool = NodePool(pool_addr, token=pool_token, block_size=block_size)
    cfg = SimServerConfig(model=model, adapters=tuple(adapters), max_model_len=max_model_len,
                          engine=engine, time_scale=time_scale, engine_id=engine_id, pool=pool)
    if replay_endpoint and not events_endpoint:
        click.echo("quillcache-sim-engine: --kv-events-replay needs --kv-events", err=True)
        sys.exit(exitcodes.USAGE)
    if credential_file and not etcd:
        click.echo("quillcache-sim-engine: --credential-file needs --etcd (it signs the registration)", err=True)
        sys.exit(exitcodes.USAGE)
    on_listening = None
    if etcd:
        from quillcache.cluster.engines import cluster_args, etcd_client_missing
        if etcd_client_missing():
            click.echo(f"quillcache-sim-engine: --etcd: {etcd_client_missing()}", err=True)
            sys.exit(exitcodes.UNAVAILABLE)
        from quillcache.gateway.settings import engine_of_record
        try:
            endpoints, cluster_id, ttl = cluster_args(etcd, cluster_id, lease_ttl)
            keys = registrant_keys(credential_file, cluster_id)
            # The record as the gateways will check it (the URL and endpoints are known once bound).
            engine_of_record({"id": engine_id or "sim-0", "url": "http://127.0.0.1:1", "model": model,
                              "adapters": list(adapters), "block_size": block_size, "role": role},
                             engine_id or "sim-0")
        except ConversionError as exc:
            click.echo(f"quillcache-sim-engine: {exc}", err=True)
            sys.exit(exitcodes.USAGE)
        on_listening = _registrar(endpoints, cluster_id, ttl, engine_id, model, adapters, block_size,
                                  role, advertise_host, keys)
    try:
        serve_forever(cfg, host, port, events_endpoint, replay_endpoint, kv_topic,
                      announce=lambda line: click.echo(line), on_listening=on_listening)
    except (OSError, zmq.ZMQError) as exc:
        click.echo(f"quillcache-sim-engine: cannot listen: {exc}", err=True)
        sys.exit(exitcodes.UNAVAILABLE)
    finally:
        if pool is not None:
            pool.close()


def _registrar(endpoints, cluster_id, ttl, engine_id, model, adapters, block_size, role, host, keys):
    """What registers the engine once it is bound: its record, the gateway's engine table,
    signed with ``keys`` (the pool's)."""
    from quillcache import __version__
    from quillcache.cluster.engines import EngineRegistration, advertised

    def register(listening):
        url = advertised(listening.http, host)
        record = {"id": engine_id or f"sim-{url.rsplit(':', 1)[1]}", "url": url, "model": model,
                  "adapters": list(adapters), "block_size": block_size, "role": role}
        if listening.events:
            record["kv_events"] = advertised(listening.events, host)
        if listening.replay:
            record["kv_replay"] = advertised(listening.replay, host)
        reg = EngineRegistration(endpoints=endpoints, cluster_id=cluster_id, record=record, ttl=ttl,
                                 version=__version__, keys=keys)
        reg.start()
        return reg.stop

    return register


if __name__ == "__main__":
    main()
