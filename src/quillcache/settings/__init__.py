"""The settings framework (``registry``) and the converters (``convert``) shared by the node's
config (``quillcache.node.settings``) and the gateway's (``quillcache.gateway.settings``)."""
from quillcache.settings.convert import ConversionError, parse_byte_size, parse_duration
from quillcache.settings.registry import Config, ConfigError, Registry, Setting

__all__ = ["Config", "ConfigError", "ConversionError", "Registry", "Setting", "parse_byte_size", "parse_duration"]
