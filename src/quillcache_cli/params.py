"""Command-line value parsing shared by the quillctl commands."""
import re

import click

from quillcache.net import ConversionError
from quillcache.settings.convert import parse_duration

_BARE_NUMBER = re.compile(r"^\s*[0-9]+(\.[0-9]+)?\s*$")


def cli_duration(value) -> float:
    """A duration from the command line: "200ms", "10s", "2m", or a bare number of seconds."""
    if isinstance(value, str) and _BARE_NUMBER.match(value):
        return float(value)
    try:
        return parse_duration(value)
    except ConversionError as exc:
        raise click.BadParameter(f"{exc}; a bare number means seconds") from None
