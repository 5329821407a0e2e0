"""Importable test support: fixtures that start real servers (etcd, daemons)."""
