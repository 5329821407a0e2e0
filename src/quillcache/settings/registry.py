"""The settings framework: a ``Registry`` of ``Setting`` objects (name, converter, default,
reloadable or not, help) that validates a TOML file into a ``Config`` and renders the
sample file and the man page from the same table.

The node (``quillcache.node.settings``) and the gateway (``quillcache.gateway.settings``)
each build a registry; a section both read (``[auth]``, ``[router]``, ``[cluster]``) is the
same ``Setting`` objects in both.  Errors name the file, the section, the key and the bad
value with an example of a good one::

    quillcache.toml: [store] dram = "12Q": not a byte size (e.g. "4GiB")
"""
from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from quillcache.errors import ConfigError
from quillcache.net import ConversionError

__all__ = ["Setting", "Registry", "Section", "Config", "ConfigError", "parse_config", "load_config",
           "render_sample", "toml_value"]


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True, slots=True)
class Setting:
    section: str
    name: str
    convert: Callable[[Any], Any]
    default: Any                 # the TOML value (as written in a file)
    reloadable: bool
    help: str

    @property
    def qualname(self) -> str:
        return f"{self.section}.{self.name}"


class Registry:
    """The settings of one kind of configuration file: the node's, or the gateway's.

    Both are validated, sampled and documented by the same code; a program shares a
    section with another by passing the same ``Setting`` objects (``[auth]``, ``[router]``)."""

    def __init__(self, name: str, sections: Mapping[str, str], settings: Iterable[Setting],
                 check: Callable[["Config"], None] | None = None, *, title: str = "") -> None:
        self.name = name
        self.title = title or name     # "node" in the sample's first line
        self.sections = dict(sections)
        self.settings = tuple(settings)
        self.by_section: dict[str, dict[str, Setting]] = {}
        for setting in self.settings:
            self.by_section.setdefault(setting.section, {})[setting.name] = setting
        missing = set(self.sections) ^ set(self.by_section)
        if missing:
            raise ValueError(f"registry {name}: sections without settings or summary: {sorted(missing)}")
        self.check = check


# --------------------------------------------------------------------------- resolved config


class Section:
    """Converted values of one section, as attributes (``cfg.store.dram``)."""

    __slots__ = ("_name", "_values")

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"[{self._name}] has no setting {key!r}") from None

    def __setattr__(self, key, value):
        raise AttributeError("configuration sections are read-only")

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)


class Config:
    """A validated configuration: ``raw`` holds TOML values, sections hold converted ones."""

    def __init__(self, raw: Mapping[str, Mapping[str, Any]], source: str,
                 registry: Registry) -> None:
        self.source = source
        self.registry = registry
        self.raw = {s: dict(v) for s, v in raw.items()}
        self._sections = {}
        for section, settings in registry.by_section.items():
            values = {}
            for name, setting in settings.items():
                value = self.raw.get(section, {}).get(name, setting.default)
                values[name] = setting.convert(value)
            self._sections[section] = Section(section, values)
        if registry.check is not None:
            registry.check(self)

    def __getattr__(self, section: str) -> Section:
        sections = self.__dict__.get("_sections", {})
        if section in sections:
            return sections[section]
        raise AttributeError(f"no configuration section [{section}]")

    def get(self, qualname: str) -> Any:
        section, name = qualname.split(".", 1)
        return getattr(self._sections[section], name)

    def reloadable_changes(self, other: "Config") -> tuple[dict[str, Any], list[str]]:
        """What changed from self to other: (reloadable {qualname: new value}, fixed qualnames)."""
        apply, fixed = {}, []
        for setting in self.registry.settings:
            old, new = self.get(setting.qualname), other.get(setting.qualname)
            if old != new:
                if setting.reloadable:
                    apply[setting.qualname] = new
                else:
                    fixed.append(setting.qualname)
        return apply, fixed

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Config":
        """A new config with ``{"node.listen": "127.0.0.1:0"}``-style overrides (validated)."""
        raw = {s: dict(v) for s, v in self.raw.items()}
        for qualname, value in overrides.items():
            section, name = qualname.split(".", 1)
            raw.setdefault(section, {})[name] = value
        return parse_config(raw, self.source + " (with command-line overrides)", self.registry)


# --------------------------------------------------------------------------- loading


def _did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[...]"
    if isinstance(value, dict):
        return "{...}"
    return str(value)


def parse_config(raw: Mapping[str, Any], source: str, registry: Registry) -> Config:
    """Validate a parsed TOML document; raises ConfigError naming source, section, key, value."""
    by_section = registry.by_section
    for section, table in raw.items():
        if section not in by_section:
            raise ConfigError(f"{source}: unknown section [{section}]{_did_you_mean(section, by_section)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section} must be a table ([{section}])")
        for name, value in table.items():
            settings = by_section[section]
            if name not in settings:
                hint = _did_you_mean(name, settings)
                if not hint:  # a key put in the wrong section
                    elsewhere = [s for s, keys in by_section.items() if name in keys]
                    if elsewhere:
                        hint = f" (it belongs in [{elsewhere[0]}])"
                raise ConfigError(f"{source}: [{section}] unknown key {name!r}{hint}")
            try:
                settings[name].convert(value)
            except ConversionError as exc:
                raise ConfigError(f"{source}: [{section}] {name} = {_show(value)}: {exc}") from None
    return Config(raw, source, registry)


def load_config(path: str | None = None, text: str | None = None, source: str | None = None, *,
                registry: Registry) -> Config:
    """Load from a file path, from TOML text, or (neither) the embedded defaults."""
    if path is not None and text is None:
        source = source or path
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not UTF-8 text") from None
    source = source or "quillcache.toml"
    if text is None:
        return parse_config({}, "(embedded defaults)", registry)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(raw, source, registry)


# --------------------------------------------------------------------------- sample


def toml_value(value: Any) -> str:
    if isinstance(value, list) and not value:
        return "[]"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    return _show(value)


def _wrap(text: str, width: int = 88, prefix: str = "# ") -> list[str]:
    import textwrap
    return [prefix + line for line in textwrap.wrap(text, width - len(prefix))]


def render_sample(registry: Registry) -> str:
    """The full default configuration, commented from the registry's help text."""
    what = registry.title
    lines = [
        f"# QuillCache {what} configuration (quillcache.toml(5)).",
        "# Generated from the settings registry by `quillctl config sample`; every key is shown",
        "# with its default. Keys marked (reloadable) take effect on SIGHUP.",
    ]
    for section, summary in registry.sections.items():
        lines += ["", f"[{section}]"] + _wrap(summary)
        for setting in registry.by_section[section].values():
            note = " (reloadable)" if setting.reloadable else ""
            lines += _wrap(setting.help + note)
            lines.append(f"{setting.name} = {toml_value(setting.default)}")
    return "\n".join(lines) + "\n"
