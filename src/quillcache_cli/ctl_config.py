"""`quillctl config ...` and `quillctl auth ...`: offline commands on configuration."""
import sys

import click

from quillcache.node.settings import ConfigError, load_config, render_sample
from quillcache.settings.convert import hash_token

from quillcache_cli import exitcodes


@click.group("config")
def config_group():
    """Print, check and explain the node configuration."""


@config_group.command("sample")
def config_sample():
    """Print the full default configuration, commented."""
    click.echo(render_sample(), nl=False)


@config_group.command("check")
@click.argument("file", type=click.Path(allow_dash=True, dir_okay=False))
def config_check(file):
    """Validate FILE (- for standard input); exit 0 if valid, 78 if not."""
    try:
        if file == "-":
            load_config(text=sys.stdin.read(), source="<stdin>")
        else:
            load_config(file)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exitcodes.CONFIG)
    click.echo(f"{'<stdin>' if file == '-' else file}: ok")


@click.group("auth")
def auth_group():
    """Tenant tokens."""


@auth_group.command("hash-token")
@click.argument("token", required=False)
def auth_hash_token(token):
    """Print the hashed form of TOKEN for [[auth.tenants]] (read from stdin if omitted or -)."""
    if token is None or token == "-":
        token = sys.stdin.readline().rstrip("\n")
    if not token:
        raise click.UsageError("empty token")
    click.echo(hash_token(token))
