"""quillctl: the admin CLI of a QuillCache node.  Thin: one request per command."""
import click

from quillcache_cli.ctl_config import auth_group, config_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quillcache")
def main():
    """Administer a QuillCache node."""


main.add_command(config_group)
main.add_command(auth_group)
