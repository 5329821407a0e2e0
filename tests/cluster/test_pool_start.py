"""The pool helper the cluster tests and benches share (tests/_support/cluster.py): a node that
does not come up stops the nodes started before it, so a failed start leaves no daemon behind
(``__exit__`` does not run when ``__enter__`` raises)."""
import pytest

from tests._support.cluster import Pool


def test_a_node_that_does_not_come_up_stops_the_ones_started_before_it(etcd, tmp_path):
    pool = Pool(tmp_path / "pool", etcd.endpoint, 2, transport="tcp")     # no UCX: a killed node leaves no /dev/shm
    pool["b"].config.write_text("this is not a config [")
    with pytest.raises(RuntimeError, match="quillcached exited"):
        with pool:
            pass
    a = pool["a"]
    assert a.proc is not None and a.proc.poll() is not None      # started, then stopped
