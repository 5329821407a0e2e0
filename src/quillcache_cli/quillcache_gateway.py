"""quillcache-gateway: the OpenAI-compatible gateway (a thin front end)."""
import sys

import click

from quillcache.node.settings import ConfigError

from quillcache_cli import exitcodes


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True,
             epilog="Settings: every section and key, commented with its default, is printed by "
                    "`quillcache-gateway config sample` ([gateway], [router], [cluster], ...); "
                    "`quillctl config check FILE` validates a file.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML configuration file (default: the embedded defaults, which name no engine).")
@click.option("--listen", help="Override [gateway] listen, e.g. 127.0.0.1:8088.")
@click.version_option(package_name="quillcache")
@click.pass_context
def main(ctx, config_path, listen):
    """Route OpenAI requests to engines with the QuillCache control plane.

    SIGTERM/SIGINT let answers in flight finish and stop; SIGHUP reloads the file's
    reloadable settings.  A bad configuration exits 78.
    """
    if ctx.invoked_subcommand is not None:
        return
    from quillcache.gateway.settings import load_gateway_config

    def load():
        cfg = load_gateway_config(config_path)
        return cfg.with_overrides({"gateway.listen": listen}) if listen else cfg
    try:
        cfg = load()
    except ConfigError as exc:
        click.echo(f"quillcache-gateway: {exc}", err=True)
        sys.exit(exitcodes.CONFIG)
    if not cfg.gateway.engines and not cfg.cluster.enabled:
        click.echo(f"quillcache-gateway: {cfg.source}: [gateway] engines is empty and [cluster] is not "
                   "enabled: name at least one [[gateway.engines]] (see conf/gateway.toml) or take "
                   "them from etcd ([cluster] enabled = true)", err=True)
        sys.exit(exitcodes.CONFIG)
    from quillcache.gateway.server import run
    sys.exit(run(cfg, reload=load if config_path else None))


@main.group("config")
def config_group():
    """Print the gateway's settings."""


@config_group.command("sample")
def config_sample():
    """Print the full default gateway configuration, commented (every setting)."""
    from quillcache.gateway.settings import GATEWAY_REGISTRY
    from quillcache.node.settings import render_sample
    click.echo(render_sample(GATEWAY_REGISTRY), nl=False)


if __name__ == "__main__":
    main()
