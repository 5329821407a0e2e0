"""quillcached: the node daemon (front end; the work is in quillcache.daemon)."""
import sys

import click


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None)
def main(config_path):
    click.echo("quillcached: the daemon is not built yet", err=True)
    sys.exit(1)
