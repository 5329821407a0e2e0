"""Importable test support: fixtures that start real servers (daemon, etcd, engines, gateway)."""
