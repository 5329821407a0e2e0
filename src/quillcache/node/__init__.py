"""The node: the daemon, its server (the binary protocol over TCP and the Unix socket), the
located (shared-memory) ops, its metrics and its settings table."""
