"""QuillCache: a distributed KV-cache pool and cache-aware control plane for LLM serving."""
from quillcache.model import CacheTier, IdentityScope, KvBlockKey

__version__ = "0.1.0"
__all__ = ["CacheTier", "IdentityScope", "KvBlockKey", "__version__"]
