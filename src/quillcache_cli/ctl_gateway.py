"""`quillctl gateway`: the gateway's workers, their load and hit rates (one HTTP request)."""
import json
import re
import urllib.error
import urllib.request

import click

from quillcache_cli import exitcodes
from quillcache_cli.ctl_data import _want_json, fail, json_option, table

DEFAULT_GATEWAY = "http://127.0.0.1:8089"      # [gateway] admin_listen: the operator's endpoints


def gateway_url(value: str) -> str:
    """The gateway's base URL from --addr: ``HOST:PORT`` or ``http(s)://HOST:PORT[/]``."""
    if not re.match(r"^https?://", value):
        value = "http://" + value
    m = re.match(r"^(https?)://([^/\s:]+|\[[0-9a-fA-F:.]+\]):([0-9]{1,5})/?$", value)
    if not m or not 0 < int(m.group(3)) <= 65535:
        raise click.BadParameter(f"{value!r}: not a gateway address (e.g. 127.0.0.1:8089 or "
                                 "http://127.0.0.1:8089)", param_hint="--addr")
    return f"{m.group(1)}://{m.group(2)}:{m.group(3)}"


@click.command("gateway")
@click.option("--addr", "--url", "addr", envvar="QUILLCACHE_GATEWAY", default=None,
              help=f"The gateway's admin address, [gateway] admin_listen: HOST:PORT or its base URL (env "
                   f"QUILLCACHE_GATEWAY; default {DEFAULT_GATEWAY}, or the --addr given before the command). "
                   "--url is the old name.")
@json_option
@click.pass_context
def gateway_cmd(ctx, addr, as_json):
    """Show the gateway's workers: model, role, where they come from (config or etcd), health,
    requests in flight, routed, hit rate, load; with [cluster] enabled, the etcd view's state and
    the engine records it does not serve, with the reason."""
    root = ctx.find_root()
    if addr is None and root.get_parameter_source("addr").name == "COMMANDLINE":
        addr = root.params["addr"]           # `quillctl --addr HOST:PORT gateway`: one option everywhere
    url = gateway_url(addr or DEFAULT_GATEWAY)
    timeout = (root.obj or {}).get("timeout", 10.0)
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/quillcache/workers", timeout=timeout) as r:
            doc = json.load(r)
    except urllib.error.HTTPError as exc:
        fail(exitcodes.FAILURE, f"{url}: HTTP {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        fail(exitcodes.UNAVAILABLE, f"cannot reach the gateway at {url}: {getattr(exc, 'reason', exc)}")
    except ValueError:
        fail(exitcodes.SOFTWARE, f"{url}: the answer is not JSON")
    if _want_json(ctx, as_json):
        click.echo(json.dumps(doc, indent=2))
        return
    rows = [[w["id"], w["model"], w.get("role", "both"), w.get("source", "config"),
             "yes" if w["healthy"] else f"no ({w['reason']})", w["in_flight"], w["routed"],
             f"{100 * w['hit_rate']:.1f}%", w.get("active_prefill_tokens", ""), w.get("decode_blocks", ""),
             _kv_pages(w), "-" if w["last_event_s"] is None else f"{w['last_event_s']:.1f}s", w["url"]]
            for w in doc["workers"]]
    click.echo(table(rows, ["WORKER", "MODEL", "ROLE", "FROM", "HEALTHY", "IN_FLIGHT", "ROUTED", "HIT_RATE",
                            "PREFILL_TOK", "DECODE_BLK", "KV_PAGES", "LAST_EVENT", "URL"]))
    cluster = doc.get("cluster")
    if cluster:
        click.echo(f"etcd: {cluster['state']}, cluster {cluster['cluster_id']}, {len(cluster['engines'])} "
                   f"engines from etcd ({cluster['added']} joined, {cluster['removed']} left so far)")
        for eid, why in sorted(cluster["rejected"].items()):
            click.echo(f"not served: {eid}: {why}")


def _kv_pages(w: dict) -> str:
    """Pages held by the requests in flight / the engine's KV pages ("-": not known)."""
    held, total = w.get("kv_pages"), w.get("kv_blocks")
    if held is None:
        return "-"
    return f"{held}/{total if total else '-'}"
