"""`quillctl config ...` and `quillctl auth ...`: offline commands on configuration."""
import sys
import tomllib

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
    """Validate FILE (- for standard input), a node configuration or, when it has a [gateway]
    section, a gateway one (quillcache-gateway's); exit 0 if valid, 78 if not."""
    from quillcache.gateway.settings import GATEWAY_REGISTRY

    source = "<stdin>" if file == "-" else file
    try:
        if file == "-":
            text = sys.stdin.read()
        else:
            with open(file, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        click.echo(f"{file}: cannot read: {getattr(exc, 'strerror', None) or exc}", err=True)
        sys.exit(exitcodes.CONFIG)
    gateway = _is_gateway(text)
    try:
        load_config(text=text, source=source, **({"registry": GATEWAY_REGISTRY} if gateway else {}))
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exitcodes.CONFIG)
    click.echo(f"{source}: ok ({'gateway' if gateway else 'node'} configuration)")


def _is_gateway(text: str) -> bool:
    """A gateway file names [gateway] (or [[gateway.engines]]); a node's never does."""
    try:
        return "gateway" in tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False                 # the node's loader reports the syntax error with its line


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
