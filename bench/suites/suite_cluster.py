"""asv suite: a cross-node fetch.  A real etcd and two real nodes on loopback
(tests/_support: EtcdServer, Pool; ``cache_remote = false``, so every GET at the second node
crosses to the holder); BLOCKS blocks are written to node A and read through node B, and
read at A itself as the baseline of the same run.  bench/cluster.py measures the same with
three nodes, the two-hop floor and failure detection.

Skipped (NotImplementedError in setup, shown as n/a) where etcd is not installed.
"""
import shutil
import tempfile

BLOCKS = 16                 # blocks read per timed call
BLOCK_BYTES = 256 << 10     # bytes per block
# The node-to-node transports a node can run (quillcache.transfer): TCP is the only one today.
# A second one (RDMA) adds its name here and its [cluster] setting in setup.
TRANSPORTS = ("tcp",)


class CrossNodeGet:
    params = list(TRANSPORTS)
    param_names = ["transport"]
    timeout = 120

    def setup(self, transport):
        from tests._support.etcd import EtcdServer, etcd_binary
        if etcd_binary() is None:
            raise NotImplementedError("etcd is not installed (Debian etcd-server; `make deps` installs it)")
        self.tmp = tempfile.mkdtemp(prefix="qc-asv-cluster-")
        self.etcd = self.pool = None
        self.clients = []
        try:
            self._start(EtcdServer)
        except BaseException:
            self.teardown(transport)
            raise

    def _start(self, EtcdServer):
        from quillcache.client import Client
        from tests._support.cluster import Pool, content, get_retry, key

        self.etcd = EtcdServer().start()
        self.pool = Pool(self.tmp, self.etcd.endpoint, n=2, dram="128MiB", max_block="1MiB")
        self.pool.start()
        self.pool.wait_members(2)
        self.at_a = Client(self.pool["a"].addr)
        self.at_b = Client(self.pool["b"].addr)
        self.clients += [self.at_a, self.at_b]
        self.keys = [key(i) for i in range(BLOCKS)]
        self.at_a.put_many([(k, content(i, BLOCK_BYTES)) for i, k in enumerate(self.keys)])
        for i, k in enumerate(self.keys):   # the first GET at B locates the holder; then B remembers it
            if get_retry(self.at_b, k) != content(i, BLOCK_BYTES):
                raise RuntimeError("cross-node GET: wrong bytes")
        counters = self.at_b.info("cluster")["Cluster"]
        if counters["remote_hits"] < BLOCKS or counters["cached_remote"] != 0:
            raise RuntimeError(f"node B did not fetch every block from A (and keep no copy): {counters}")

    def teardown(self, transport):
        for c in self.clients:
            c.close()
        if self.pool is not None:
            self.pool.close()
        if self.etcd is not None:
            self.etcd.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def time_get_via_second_node(self, transport):
        get = self.at_b.get
        for k in self.keys:
            get(k)

    def time_get_many_via_second_node(self, transport):
        self.at_b.get_many(self.keys)

    def time_get_at_holder(self, transport):
        get = self.at_a.get
        for k in self.keys:
            get(k)
