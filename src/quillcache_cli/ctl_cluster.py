"""quillctl cluster and quillctl locate: the pool as one node sees it.

``cluster``: the members (node id, address, epoch, free space, state) and this node's
cluster counters (state ok/degraded, records, re-announcement progress).
``locate KEYFIELDS``: the key's home node, its rendezvous order and the nodes that hold it.
One request each (CLUSTER_VIEW, CLUSTER_LOCATE), built and read by protocol/cluster.py's
encoders and decoders (the CLI holds no copy of a wire format).
"""
import json

import click

from quillcache_cli.ctl_data import (
    KEY_METAVAR, KEYFIELDS_HELP, _want_json, build_key, json_option, key_options, node, table,
)


def _size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:.1f}{unit}"
    return str(n)


@click.command("cluster")
@json_option
@click.pass_context
def cluster_cmd(ctx, as_json):
    """The pool as this node sees it: members, epochs, free space, state."""
    from quillcache.protocol import cluster as wire
    from quillcache.protocol.opcodes import Opcode

    with node(ctx) as client:
        view = wire.decode_json(client.call(Opcode.CLUSTER_VIEW, wire.encode_cluster_view()).header)
    if _want_json(ctx, as_json):
        click.echo(json.dumps(view, indent=2, sort_keys=True))
        return
    info = view["info"]
    click.echo(f"node {view['node_id']}  state {view['state']}  epoch {view['epoch']}  "
               f"members {sum(m['state'] == 'up' for m in view['members'])}")
    rows = [[("* " if m["self"] else "  ") + m["node_id"], m["address"], m["epoch"], _size(m["free"]),
             _size(m["capacity"]), m["state"]] for m in view["members"]]
    click.echo(table(rows, ["NODE", "ADDRESS", "EPOCH", "FREE", "CAPACITY", "STATE"]))
    click.echo(f"records {info['cluster_records']}  held {info['cluster_held']}  "
               f"re-announce {'running' if info['reannounce_active'] else 'idle'} "
               f"({info['reannounce_scanned']} scanned, {info['reannounce_queued']} re-homed, "
               f"{info['reannounce_rounds']} rounds)  remote hits {info['remote_hits']} "
               f"misses {info['remote_misses']}")


@click.command("locate", epilog=KEYFIELDS_HELP, options_metavar=KEY_METAVAR)
@key_options
@json_option
@click.pass_context
def locate_cmd(ctx, as_json, **kw):
    """A key's home node, rendezvous order and holders."""
    from quillcache.protocol import cluster as wire
    from quillcache.model import encode_key
    from quillcache.protocol.opcodes import Opcode

    with node(ctx) as client:
        key = build_key(client, kw)
        body = wire.encode_cluster_locate([encode_key(key)], client.limits)
        found = wire.decode_json(client.call(Opcode.CLUSTER_LOCATE, body).header)[0]
    if _want_json(ctx, as_json):
        click.echo(json.dumps(found, indent=2, sort_keys=True))
        return
    click.echo(f"home     {found['home']}")
    click.echo(f"order    {' '.join(found['order'])}")
    click.echo(f"holders  {' '.join(found['holders']) or '(none)'}")
