"""quillcached: the node daemon (a thin front end; the work is in quillcache.daemon)."""
import sys

import click

from quillcache.config import ConfigError, load_config, render_sample

from quillcache_cli import exitcodes


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML configuration file (default: the embedded defaults).")
@click.option("--listen", help="Override [node] listen, e.g. 127.0.0.1:7470.")
@click.option("--data-dir", help="Override [node] data_dir.")
@click.version_option(package_name="quillcache")
def main(config_path, listen, data_dir):
    """Run a QuillCache node in the foreground (systemd runs it as Type=notify)."""
    try:
        cfg = load_config(config_path)
        overrides = {}
        if listen:
            overrides["node.listen"] = listen
        if data_dir:
            overrides["node.data_dir"] = data_dir
        if overrides:
            cfg = cfg.with_overrides(overrides)
    except ConfigError as exc:
        click.echo(f"quillcached: {exc}", err=True)
        sys.exit(exitcodes.CONFIG)
    click.echo(f"quillcached: configuration from {cfg.source} is valid", err=True)
    click.echo("quillcached: the daemon is not built yet (see README status); nothing started", err=True)
    sys.exit(exitcodes.SOFTWARE)
