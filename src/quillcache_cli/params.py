"""Command-line value parsing shared by the quillctl commands."""
import re

import click

from quillcache.net import ConversionError
from quillcache.settings.convert import parse_duration

ADDRESS_HELP = 'HOST:PORT or unix:/path of the node, e.g. 127.0.0.1:7470 or "unix:var/quillcached.sock"'

_BARE_NUMBER = re.compile(r"^\s*[0-9]+(\.[0-9]+)?\s*$")


def cli_duration(value) -> float:
    """A duration from the command line: "200ms", "10s", "2m", or a bare number of seconds."""
    if isinstance(value, str) and _BARE_NUMBER.match(value):
        return float(value)
    try:
        return parse_duration(value)
    except ConversionError as exc:
        raise click.BadParameter(f"{exc}; a bare number means seconds") from None


def check_address(_ctx, _param, value):
    """A node address (HOST:PORT or unix:/path), checked before anything connects: a malformed
    one is a usage error (exit 2) that says what a good one looks like."""
    if value is None:
        return None
    from quillcache.client.calls import resolve_address
    from quillcache.errors import InvalidArgument
    try:
        resolve_address(value)
    except InvalidArgument as exc:
        raise click.BadParameter(f"{exc} ({ADDRESS_HELP})") from None
    return value


def _into_root(key: str):
    def store(ctx, param, value):
        if value is not None and ctx.get_parameter_source(param.name).name == "COMMANDLINE":
            root = ctx.find_root()
            root.obj = {**(root.obj or {}), key: value}
        return value
    return store


def connection_options(cmd: click.Command) -> click.Command:
    """Let ``cmd`` take --addr, --token, --timeout and --json after its name too (the root's
    options, given again there, win: `quillctl ping --addr X`)."""
    def addr_then_store(ctx, param, value):
        return _into_root("addr")(ctx, param, check_address(ctx, param, value))

    extra = [
        click.Option(["--addr"], default=None, expose_value=False, callback=addr_then_store,
                     help=f"{ADDRESS_HELP} (as before the command)."),
        click.Option(["--token"], default=None, expose_value=False, callback=_into_root("token"),
                     help="Tenant token sent in HELLO (as before the command)."),
        click.Option(["--timeout"], type=click.FloatRange(min=0.001, max=3600.0), default=None,
                     expose_value=False, callback=_into_root("timeout"),
                     help="Seconds to wait for the connection and each reply (as before the command)."),
    ]
    names = {o for p in cmd.params for o in getattr(p, "opts", ())}
    cmd.params.extend(o for o in extra if not set(o.opts) & names)
    if "--json" not in names:
        cmd.params.append(click.Option(["--json"], "json", is_flag=True, default=None, expose_value=False,
                                       callback=_into_root("json"), help="Print JSON (as before the command)."))
    return cmd


CREDENTIAL_HELP = ("File holding the pool's [cluster] credential (its first line; at least 16 characters). "
                   "Without it, the value of QUILLCACHE_CLUSTER_CREDENTIAL. The record is signed with a key "
                   "derived from it: the gateways route only to engines whose record it signs.")


def registrant_keys(credential_file, cluster_id: str, option: str = "--credential-file"):
    """The pool's keys (cluster.keys.ClusterKeys) for an engine registrant, from
    ``credential_file`` (its first line) or else the environment's QUILLCACHE_CLUSTER_CREDENTIAL;
    raises ConversionError (the caller exits 2) when there is none or it is too short.  The
    credential is never echoed."""
    import os

    from quillcache.cluster.keys import ClusterKeys
    from quillcache.cluster.settings import CREDENTIAL_ENV, CREDENTIAL_MIN_CHARS

    if credential_file:
        try:
            with open(credential_file, encoding="utf-8") as f:
                credential = f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{option} {credential_file}: cannot read: "
                                   f"{getattr(exc, 'strerror', None) or exc}") from None
        where = f"{option} {credential_file}"
    else:
        credential = os.environ.get(CREDENTIAL_ENV, "")
        where = CREDENTIAL_ENV
        if not credential:
            raise ConversionError(
                f"no cluster credential: give {option} PATH (a file holding the pool's [cluster] credential) "
                f"or set {CREDENTIAL_ENV}; the gateways refuse an engine record that it does not sign")
    if len(credential) < CREDENTIAL_MIN_CHARS:
        raise ConversionError(f"{where}: the cluster credential needs at least {CREDENTIAL_MIN_CHARS} "
                               "characters (the pool's [cluster] credential)")
    return ClusterKeys(credential, cluster_id)
