"""The OpenAI-compatible gateway over the control plane (quillcache-gateway)."""
