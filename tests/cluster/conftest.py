"""Fixtures of the pool tests: a real etcd per test (tests/_support/etcd.py)."""
import pytest

from tests._support.etcd import EtcdServer


@pytest.fixture
def etcd(tmp_path):
    with EtcdServer(tmp_path / "etcd") as server:
        yield server
