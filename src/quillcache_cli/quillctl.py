"""quillctl: the admin CLI of a QuillCache node.  Thin: one request per command."""
import click

from quillcache.client import DEFAULT_TIMEOUT_S
from quillcache.net import DEFAULT_ADDRESS
from quillcache.exitcodes import QUILLCTL_EXIT_CODES

from quillcache_cli.params import check_address, connection_options

from quillcache_cli.ctl_bench import bench_command
from quillcache_cli.ctl_cluster import cluster_cmd, locate_cmd
from quillcache_cli.ctl_config import auth_group, config_group
from quillcache_cli.ctl_data import DATA_COMMANDS
from quillcache_cli.ctl_engine import engine_group
from quillcache_cli.ctl_gateway import gateway_cmd
from quillcache_cli.ctl_wal import wal_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--addr", envvar="QUILLCACHE_ADDR", default=DEFAULT_ADDRESS, show_default=True,
              callback=check_address,
              help="HOST:PORT or unix:/path of the node (env QUILLCACHE_ADDR); also accepted after "
                   "the command.")
@click.option("--token", envvar="QUILLCACHE_TOKEN", default=None,
              help="Tenant token sent in HELLO (env QUILLCACHE_TOKEN); none on an open node.")
@click.option("--timeout", type=click.FloatRange(min=0.001, max=3600.0), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="Seconds to wait for the connection and for each reply.")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON instead of tables, for scripts (every command also takes --json).")
@click.version_option(package_name="quillcache")
@click.pass_context
def main(ctx, addr, token, timeout, as_json):
    """Administer a QuillCache node.

    KEYFIELDS (put, get, rm, pin, unpin) name one block with options: --model (env
    QUILLCACHE_MODEL), --tokenizer (env QUILLCACHE_TOKENIZER, default the model), --adapter
    (env QUILLCACHE_ADAPTER, default none), --tenant (env QUILLCACHE_TENANT, default the
    token's tenant), --prefix-hash, --block-hash, --index (default 0), --tokens (default 64).
    Every field is taken verbatim, so model ids with "/" need no quoting; or --key HEX, the
    encoded key that `ls --json` prints.

    --addr, --token, --timeout and --json go before or after the command
    (`quillctl ping --addr 127.0.0.1:7470`).

    {exit_codes}
    """
    ctx.obj = {"addr": addr, "token": token, "timeout": timeout, "json": as_json}


def _exit_codes_paragraph(width: int = 88) -> str:
    """The help's exit-code paragraph, from quillcache.exitcodes (the one list)."""
    words = ("Exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in QUILLCTL_EXIT_CODES) + ".").split()
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return "\n    ".join([*lines, line])


main.help = main.help.replace("{exit_codes}", _exit_codes_paragraph())
main.add_command(config_group)
main.add_command(auth_group)
# the commands that talk to a node take the connection options after their name as well
for _cmd in (*DATA_COMMANDS, bench_command, cluster_cmd, locate_cmd):
    main.add_command(connection_options(_cmd))
main.add_command(wal_group)
main.add_command(gateway_cmd)
main.add_command(engine_group)
