"""QuillCache: a distributed KV-cache pool and cache-aware control plane for LLM serving."""
from quillcache.model import CacheTier, IdentityScope, KvBlockKey

__version__ = "0.1.0"
__all__ = ["AsyncClient", "CacheTier", "Client", "IdentityScope", "KvBlockKey", "__version__"]


def __getattr__(name: str):
    # The client pulls in the protocol codec: import it on first use so `import quillcache`
    # (the daemon, the config tools) stays light and free of import cycles.
    if name in ("Client", "AsyncClient"):
        from quillcache import client
        return getattr(client, name)
    raise AttributeError(f"module 'quillcache' has no attribute {name!r}")
