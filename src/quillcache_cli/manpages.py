"""Generate the man pages from the click commands and the settings registry.

    python -m quillcache_cli.manpages man/       (what `make man` runs)

A test regenerates them and fails when the committed pages are stale.
"""
import sys
from pathlib import Path

import click

from quillcache import __version__
from quillcache.node.settings import SECTIONS, SETTINGS
from quillcache.settings.registry import toml_value

DATE = "2026"  # fixed so that regeneration is reproducible


def _esc(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line.startswith((".", "'")) else line for line in text.split("\n"))


def _header(name: str, section: int, title: str) -> list[str]:
    return [f'.TH {name.upper()} {section} "{DATE}" "quillcache {__version__}" "{title}"']


def _options(cmd: click.Command) -> list[str]:
    out = []
    for param in cmd.params:
        if isinstance(param, click.Option) and not param.hidden:
            names = ", ".join(param.opts + param.secondary_opts)
            metavar = "" if param.is_flag else " " + (param.metavar or param.type.name.upper())
            out += [".TP", f"\\fB{_esc(names)}\\fR{_esc(metavar)}", _esc(param.help or "")]
    return out


def _usage(cmd: click.Command, path: str) -> str:
    ctx = click.Context(cmd, info_name=path)
    return " ".join(cmd.collect_usage_pieces(ctx))


def _walk(group: click.Group, prefix: str):
    for name in sorted(group.commands):
        cmd = group.commands[name]
        path = f"{prefix} {name}"
        if isinstance(cmd, click.Group):
            yield from _walk(cmd, path)
        else:
            yield path, cmd


def quillctl_page() -> str:
    from quillcache_cli.quillctl import main
    lines = _header("quillctl", 1, "QuillCache manual")
    lines += [".SH NAME", "quillctl \\- administer a QuillCache node", ".SH SYNOPSIS",
              "\\fBquillctl\\fR [\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...", ".SH DESCRIPTION",
              _esc(main.help or ""), ".SH COMMANDS"]
    for path, cmd in _walk(main, "quillctl"):
        lines += [".SS " + _esc(path), "\\fB" + _esc(path) + "\\fR " + _esc(_usage(cmd, path)),
                  ".PP", _esc((cmd.help or "").strip())]
        lines += _options(cmd)
    from quillcache_cli import exitcodes
    lines += [".SH EXIT STATUS"]
    codes = [n for n in dir(exitcodes) if n.isupper() and isinstance(getattr(exitcodes, n), int)]
    for name in sorted(codes, key=lambda n: getattr(exitcodes, n)):
        lines += [".TP", f"\\fB{getattr(exitcodes, name)}\\fR", name.lower().replace("_", " ")]
    lines += [".SH SEE ALSO", "quillcached(8), quillcache.toml(5)"]
    return "\n".join(lines) + "\n"


def quillcached_page() -> str:
    from quillcache_cli.quillcached import main
    lines = _header("quillcached", 8, "QuillCache manual")
    lines += [".SH NAME", "quillcached \\- QuillCache node daemon", ".SH SYNOPSIS",
              "\\fBquillcached\\fR " + _esc(_usage(main, "quillcached")), ".SH DESCRIPTION",
              _esc((main.help or "").strip()), ".PP",
              "The daemon never forks. It logs to standard error. With NOTIFY_SOCKET set it sends "
              "READY=1 when serving and STOPPING=1 when draining (systemd Type=notify).",
              ".SH OPTIONS"] + _options(main)
    lines += [".SH SIGNALS", ".TP", "\\fBSIGTERM\\fR, \\fBSIGINT\\fR",
              "/ready on the metrics port answers 503 draining; stop accepting, drain in-flight requests, "
              "flush the write-ahead log, exit 0.",
              ".TP", "\\fBSIGHUP\\fR", "Reload the settings marked reloadable in quillcache.toml(5).",
              ".SH EXIT STATUS"]
    from quillcache.exitcodes import QUILLCACHED_EXIT_CODES
    for code, meaning in QUILLCACHED_EXIT_CODES:
        lines += [".TP", f"\\fB{code}\\fR", _esc(meaning)]
    lines += [".SH SEE ALSO", "quillctl(1), quillcache.toml(5)"]
    return "\n".join(lines) + "\n"


def toml_page() -> str:
    lines = _header("quillcache.toml", 5, "QuillCache manual")
    lines += [".SH NAME", "quillcache.toml \\- configuration of a QuillCache node", ".SH DESCRIPTION",
              "A TOML file read by \\fBquillcached \\-\\-config\\fR. Unknown sections and keys are "
              "errors. Sizes are written like \"4GiB\", durations like \"200ms\". "
              "\\fBquillctl config sample\\fR prints every key with its default; "
              "\\fBquillctl config check\\fR validates a file.",
              ".SH SETTINGS"]
    for section, summary in SECTIONS.items():
        lines += [f".SS [{section}]", _esc(summary)]
        for s in (x for x in SETTINGS if x.section == section):
            reload_ = " (reloadable on SIGHUP)" if s.reloadable else ""
            lines += [".TP", f"\\fB{s.name}\\fR = {_esc(toml_value(s.default))}", _esc(s.help + reload_)]
    lines += [".SH SEE ALSO", "quillcached(8), quillctl(1)"]
    return "\n".join(lines) + "\n"


PAGES = {"quillctl.1": quillctl_page, "quillcached.8": quillcached_page, "quillcache.toml.5": toml_page}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "man")
    out.mkdir(parents=True, exist_ok=True)
    for name, render in PAGES.items():
        (out / name).write_text(render())
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
