"""quillcached: the node daemon (a thin front end; the work is in quillcache.node.daemon)."""
import sys

import click

from quillcache._native import REBUILD_HINT, missing_extensions
from quillcache.node.settings import ConfigError, load_config

from quillcache_cli import exitcodes


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML configuration file (default: the embedded defaults).")
@click.option("--listen", help="Override [node] listen, e.g. 127.0.0.1:7470.")
@click.option("--data-dir", help="Override [node] data_dir.")
@click.option("--unix-socket", help="Override [node] unix_socket, e.g. /run/quillcache/quillcached.sock "
              "(the systemd unit's; \"off\": none).")
@click.version_option(package_name="quillcache")
def main(config_path, listen, data_dir, unix_socket):
    """Run a QuillCache node in the foreground (systemd runs it as Type=notify).

    SIGTERM/SIGINT drain in-flight requests and stop; SIGHUP reloads the reloadable
    settings from the same file.  A bad configuration exits 78 (EX_CONFIG); a build
    without its native extensions exits 69 (EX_UNAVAILABLE).
    """
    missing = missing_extensions()
    if missing:
        for module, why in missing:
            click.echo(f"quillcached: cannot start: native extension {module} does not load ({why})", err=True)
        click.echo(f"quillcached: a broken build: {REBUILD_HINT}", err=True)
        sys.exit(exitcodes.UNAVAILABLE)
    overrides = {}
    if listen:
        overrides["node.listen"] = listen
    if data_dir:
        overrides["node.data_dir"] = data_dir
    if unix_socket:
        overrides["node.unix_socket"] = unix_socket
    try:
        cfg = load_config(config_path)
        if overrides:
            cfg = cfg.with_overrides(overrides)
    except ConfigError as exc:
        click.echo(f"quillcached: {exc}", err=True)
        sys.exit(exitcodes.CONFIG)
    from quillcache.node.daemon import run     # after validation: a bad config exits before any import cost
    sys.exit(run(cfg, config_path=config_path, overrides=overrides))
