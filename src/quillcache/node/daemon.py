"""quillcached: build one node from a Config and run it on uvloop.

Lifecycle (the process never forks; systemd runs it as Type=notify):

    start   data dir (mode 0700) -> SSD tier (recovers) -> LocalKvStore -> TCP server ->
            /metrics -> maintenance task -> sd_notify READY=1
    SIGHUP  re-read the same file; apply Config.reloadable_changes (log level, guard mode,
            lease, watermarks, tenants, ...); log what was applied and what needs a
            restart; a bad file is logged and the running config kept
    SIGTERM / SIGINT
            sd_notify STOPPING=1 -> /ready answers 503 "draining" -> stop accepting ->
            refuse new requests and wait for the ones in flight (up to [node]
            drain_timeout) -> close connections -> close the store (the SSD tier commits
            its WAL and checkpoints) -> exit 0
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from quillcache import __version__, exitcodes
from quillcache.auth import Authenticator
from quillcache.node.settings import SETTINGS, Config, ConfigError, format_hostport, load_config
from quillcache.errors import Busy, InvalidArgument, QuillCacheError
from quillcache.index.persistent import PersistentArtIndex
from quillcache.model import CacheTier
from quillcache.node.metrics import NodeMetrics
from quillcache.protocol.opcodes import ProtocolLimits
from quillcache.node.server import NodeServer
from quillcache.service import LOG_LEVELS, sd_notify, setup_logging
from quillcache.store.tiers import LocalKvStore, StoreOptions

__all__ = ["Node", "run", "MAINTENANCE_INTERVAL_S"]

log = logging.getLogger("quillcache.daemon")

MAINTENANCE_INTERVAL_S = 1.0     # seconds between store.maintenance() calls
LISTEN_BACKLOG = 1024            # pending TCP connections the kernel queues
UNIX_SOCKET_NAME = "quillcached.sock"    # in data_dir, unless [node] unix_socket names a path
UNIX_SOCKET_MODE = 0o660         # owner and group may connect (the group is the fence in open mode)
UNIX_PATH_MAX = 108              # bytes of sun_path, the terminating NUL included
# --------------------------------------------------------------------------- the node


class Node:
    """One running node: store, optional SSD tier, TCP server, metrics, maintenance."""

    def __init__(self, cfg: Config, *, config_path: Optional[str] = None,
                 overrides: Optional[Mapping[str, Any]] = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.ssd = None
        self.store: Optional[LocalKvStore] = None
        self.server: Optional[NodeServer] = None
        self.metrics: Optional[NodeMetrics] = None
        self.router = None              # control.host.RouterHost when [router] module is not "none"
        self.residency = None           # control.residency.ResidencyPublisher when [events] publish
        self.address: Optional[tuple[str, int]] = None
        self.metrics_address: Optional[tuple[str, int]] = None
        self.node_id = cfg.node.id or socket.gethostname()
        self._listener: Optional[asyncio.base_events.Server] = None
        self._unix_listener: Optional[asyncio.base_events.Server] = None
        self.unix_path: Optional[str] = None      # the Unix socket's path while it listens
        self._maint: Optional[asyncio.Task] = None
        self._stop = asyncio.Event()
        self._reload_held = False      # a SIGHUP that landed during start (install_signals)
        self._reload_ready = False     # start() returned: a SIGHUP reloads
        self._stopped = False
        self.cluster = None

    # ------------------------------------------------------------------ start

    async def _open_ssd(self, data_dir: Path):
        from quillcache.store.ssd import SsdTier    # a broken build fails here, loudly (quillcached checks first)
        cfg = self.cfg
        path = cfg.ssd.path or str(data_dir / "ssd" / "blocks.dat")
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (data_dir / "wal").mkdir(exist_ok=True, mode=0o700)     # before the WAL makes it 0755
        t0 = time.monotonic()
        tier = await SsdTier.open(
            path, cfg.ssd.capacity, wal_dir=str(data_dir / "wal"), direct_io=cfg.ssd.direct_io,
            verify=cfg.ssd.verify, commit_window_s=cfg.wal.commit_window, sync=cfg.wal.sync,
            wal_backend=cfg.wal.backend, segment_bytes=cfg.wal.segment_size,
            max_block_bytes=min(cfg.store.max_block, cfg.ssd.capacity))
        st = tier.stats()
        log.info("SSD tier %s: %d blocks recovered (%d dropped) in %.3f s", path,
                 st.get("recovered_blocks", 0), st.get("dropped_blocks", 0), time.monotonic() - t0)
        return tier

    def _open_index(self, data_dir: Path):
        """The persistent residency index ([index] persistent): its records of DRAM copies
        are never logged (they do not outlive the process), nor other nodes' records (a
        pool's soft state, re-announced after a restart): only this node's are its owner's."""
        cfg = self.cfg
        return PersistentArtIndex(data_dir / "index", volatile_tiers=(CacheTier.CPU_DRAM,),
                                  wal_backend=cfg.wal.backend, owner=self.node_id)

    async def start(self) -> None:
        cfg = self.cfg
        data_dir = Path(cfg.node.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if cfg.ssd.enabled:
            self.ssd = await self._open_ssd(data_dir)
        if cfg.store.policy == "write_through" and self.ssd is None:
            raise ConfigError(f"{cfg.source}: [store] policy = \"write_through\": needs the SSD tier "
                              "([ssd] enabled = true)")
        wal_backend = str(self.ssd.stats().get("wal_backend")) if self.ssd is not None else "none"
        log.info("WAL backend: %s%s", wal_backend, "" if self.ssd is not None else " (SSD tier disabled)")
        index = None
        if cfg.index.persistent:
            index = await asyncio.to_thread(self._open_index, data_dir)
        options = StoreOptions(
            cfg.store.dram, policy=cfg.store.policy, holder=self.node_id,
            high_watermark=cfg.store.high_watermark, low_watermark=cfg.store.low_watermark,
            demote_after_s=cfg.store.demote_after or None, lease_s=cfg.store.lease,
            guard_mode=cfg.guard.mode, max_block_bytes=cfg.store.max_block,
            put_timeout_s=cfg.store.put_timeout, hugepages=cfg.store.hugepages, prefault=cfg.store.prefault,
            promote_on_get=cfg.ssd.promote_on_get, pin_quotas=_pin_quotas(cfg.auth.tenants))
        self.store = LocalKvStore(options, ssd=self.ssd, index=index)
        if index is not None:
            r = self.store.reconciled
            log.info("residency index %s: %d records recovered in %.3f s CPU; against the SSD tier: "
                     "%d agreed, %d added, %d dropped", index.directory, index.recovery.checkpoint_records
                     + index.recovery.replayed, index.recovery.cpu_seconds, r["index_agreed"],
                     r["index_added"], r["index_dropped"])
        limits = ProtocolLimits(max_header_bytes=cfg.limits.max_header, max_payload_bytes=cfg.limits.max_payload,
                                max_batch=cfg.limits.max_batch, max_in_flight=cfg.limits.max_inflight)
        auth = Authenticator(cfg.auth.tenants, cfg.auth.max_failed_hellos)
        if auth.open_mode:
            log.warning("open mode (no tenants configured): any client may read and write any key")
        else:
            log.info("auth mode: %d tenants", len(auth.tenant_names))
        if cfg.metrics.enabled:
            self.metrics = NodeMetrics(self.node_id, __version__)
            self.metrics.set_wal_backend(wal_backend)
        self._start_control()
        self.server = NodeServer(self.store, limits=limits, auth=auth, metrics=self.metrics,
                                 max_connections=cfg.limits.max_connections, node_id=self.node_id,
                                 version=__version__, ssd=self.ssd,
                                 sendfile=cfg.ssd.sendfile, shm=cfg.node.shm, router=self.router,
                                 hello_timeout=cfg.node.hello_timeout, idle_timeout=cfg.node.idle_timeout,
                                 max_unauthenticated=cfg.limits.max_unauthenticated,
                                 max_unauthenticated_per_source=cfg.limits.max_unauthenticated_per_source,
                                 loopback_congestion=cfg.node.loopback_congestion)
        self.server.wal_backend = wal_backend
        loop = asyncio.get_running_loop()
        host, port = cfg.node.listen
        # The Unix socket listens before the TCP port: a client that finds the port open (a probe,
        # a test harness, quillctl right after start) finds the Unix socket there too.
        await self._listen_unix(data_dir)
        self._listener = await loop.create_server(self.server.protocol_factory, host, port,
                                                  reuse_address=True, backlog=LISTEN_BACKLOG)
        self.address = self._listener.sockets[0].getsockname()[:2]
        self.server.listen = format_hostport(self.address)
        if self.metrics is not None:    # before the pool: NIXL's UCX binds ephemeral ports of its own
            self.metrics_address = self.metrics.serve(*cfg.metrics.listen)
            self.metrics.update_store(self._snapshot())
        if cfg.cluster.enabled:
            await self._join_cluster(limits, auth)
        self._maint = loop.create_task(self._maintenance())
        log.info("quillcached %s node %s listening on %s%s", __version__, self.node_id, self.server.listen,
                 f", metrics on http://{format_hostport(self.metrics_address)}/metrics"
                 if self.metrics_address else "")
        sd_notify(f"READY=1\nSTATUS=serving on {self.server.listen}\nMAINPID={os.getpid()}")

    async def _listen_unix(self, data_dir: Path) -> None:
        """The Unix-domain listener (docs/shm.md): bound, made 0660, then listening, so no
        client can connect before the mode is set."""
        path = self.cfg.node.unix_socket or str(data_dir / UNIX_SOCKET_NAME)
        if path == "off":
            return
        if len(os.fsencode(path)) >= UNIX_PATH_MAX:
            raise ConfigError(f"{self.cfg.source}: [node] unix_socket = {path!r}: longer than the "
                              f"{UNIX_PATH_MAX - 1} bytes a Unix socket path may have")
        _unlink_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, UNIX_SOCKET_MODE)
            sock.listen(LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        self._unix_listener = await asyncio.get_running_loop().create_unix_server(
            self.server.unix_protocol_factory, sock=sock)
        self.unix_path = path
        self.server.unix_path = path
        log.info("Unix socket %s (mode %o), arena sharing %s", path, UNIX_SOCKET_MODE,
                 "on" if self.server.shm else "off")

    def _start_control(self) -> None:
        """The hosted router ([router]) and the residency publisher ([events]), if configured."""
        cfg = self.cfg
        if cfg.router.module != "none":
            from quillcache.control.host import build_router_host
            self.router = build_router_host(cfg.router)
            if self.metrics is not None:
                self.router.export_metrics(self.metrics.registry)
            log.info("router module %s: %d engines", cfg.router.module, len(cfg.router.engines))
        if cfg.events.publish:
            from quillcache.control.residency import ResidencyPublisher
            try:
                self.residency = ResidencyPublisher(
                    self.node_id, cfg.events.endpoint, cfg.events.replay_endpoint or None,
                    buffer_steps=cfg.events.buffer_steps)
            except Exception as exc:          # zmq.ZMQError: a bad or busy endpoint
                raise ConfigError(f"{cfg.source}: [events] endpoint = {cfg.events.endpoint!r}: "
                                  f"cannot bind ({exc})") from None
            self.store.on_residency = self.residency
            log.info("residency events on %s (replay %s)", self.residency.endpoint,
                     self.residency.replay_endpoint)
    async def _join_cluster(self, limits: ProtocolLimits, auth: Authenticator) -> None:
        from quillcache.cluster.engines import etcd_client_missing
        from quillcache.cluster.hook import ClusterHook, default_node_id   # etcd3gw only when clustered
        cfg = self.cfg
        missing = etcd_client_missing()
        if missing:
            raise ConfigError(f"{cfg.source}: [cluster] enabled = true, but {missing}")
        node_id = default_node_id(cfg.cluster.node_id, cfg.node.id)
        advertise = format_hostport(cfg.cluster.advertise) if cfg.cluster.advertise else self.server.listen
        self.cluster = ClusterHook(cfg.cluster, store=self.store, node_id=node_id, address=advertise,
                                   limits=limits, version=__version__, auth=auth)
        from quillcache.cluster.grants import use_transport     # [cluster] transport: NIXL or TCP
        self.cluster.grants = use_transport(self.cluster, self.store)
        self.server.cluster = self.cluster
        await self.cluster.start()
        log.info("cluster %s: node %s (epoch %x) advertised at %s, etcd %s", cfg.cluster.cluster_id, node_id,
                 self.cluster.epoch, advertise, ", ".join(format_hostport(e) for e in cfg.cluster.etcd))

    def _snapshot(self) -> dict:
        st = self.store.stats()
        if self.ssd is not None:
            s = self.ssd.stats()
            st["wal"] = {"commit_p50_s": s.get("commit_p50_ms", 0.0) / 1000.0,
                         "commit_p99_s": s.get("commit_p99_ms", 0.0) / 1000.0}
        return st

    async def _maintenance(self) -> None:
        loop = asyncio.get_running_loop()
        last_checkpoint = loop.time()
        while True:
            await asyncio.sleep(MAINTENANCE_INTERVAL_S)
            try:
                self.server.expire_slow_writers()
                self.server.close_idle()
                await self.store.maintenance()
                # Periodic checkpoint: bounds WAL replay at restart ([wal] checkpoint_interval,
                # read from the current config so SIGHUP applies it).
                if self.ssd is not None and loop.time() - last_checkpoint >= self.cfg.wal.checkpoint_interval:
                    last_checkpoint = loop.time()
                    await self.ssd.checkpoint()
                if self.metrics is not None:
                    self.metrics.update_store(self._snapshot())
                    if self.cluster is not None:
                        self.metrics.set_cluster_state(self.cluster.cluster_state)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("maintenance failed")

    # ------------------------------------------------------------------ signals

    def install_signals(self, *, reload: bool = True) -> None:
        """TERM and INT request a stop; HUP reloads once the node has started.

        Before that (``reload=False``) a HUP is held, not acted on: the TCP port listens
        before start() returns, and HUP's default action would kill a node that a probe
        or an operator's reload found listening. The held reload runs when the second
        call (``reload=True``, after start) marks the node up."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        # One HUP handler throughout: a HUP's callback can run after this call, so it reads
        # whether the node is up when it runs, not when the signal was caught.
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        if not reload:
            return
        self._reload_ready = True
        if self._reload_held:
            self._reload_held = False
            log.info("SIGHUP arrived during start: reloading now")
            loop.create_task(self.reload())

    def _on_hup(self) -> None:
        if self._reload_ready:
            asyncio.get_running_loop().create_task(self.reload())
        else:
            self._reload_held = True

    def request_stop(self, why: str = "") -> None:
        if not self._stop.is_set():
            log.info("%s: stopping", why or "stop requested")
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    # ------------------------------------------------------------------ reload

    async def reload(self) -> tuple[dict, list]:
        """Re-read the config file and apply what can change at run time."""
        try:
            new = load_config(self.config_path)
            if self.overrides:
                new = new.with_overrides(self.overrides)
        except ConfigError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
            return {}, []
        apply, fixed = self.cfg.reloadable_changes(new)
        applied = {}
        for name, value in apply.items():
            try:
                self._apply(name, value, new)
            except Exception as exc:
                log.error("reload: %s = %r not applied: %s", name, value, exc)
                continue
            applied[name] = value
        if applied:
            log.info("reload: applied %s", ", ".join(f"{k}={_show(v)}" for k, v in applied.items()))
        else:
            log.info("reload: no reloadable setting changed")
        if fixed:
            log.warning("reload: changed but need a restart (not applied): %s", ", ".join(fixed))
        self.cfg = _merge(self.cfg, new, list(applied))
        return applied, fixed

    def _apply(self, name: str, value: Any, new: Config) -> None:
        hook = RELOAD_HOOKS.get(name)
        if hook is None:
            raise ConfigError("no run-time hook for this setting (restart to apply)")
        hook(self, value, new)

    # ------------------------------------------------------------------ stop

    async def stop(self) -> bool:
        """Drain and shut down; returns True when every in-flight request finished."""
        if self._stopped:
            return True
        self._stopped = True
        sd_notify("STOPPING=1")
        if self.metrics is not None:
            self.metrics.set_ready(False, "draining")   # first: load balancers stop sending here
        drained = True
        if self._listener is not None:
            self._listener.close()              # stop accepting
        if self._unix_listener is not None:
            self._unix_listener.close()
            try:
                os.unlink(self.unix_path)       # the next start binds a fresh one
            except OSError:
                pass
        if self.cluster is not None:
            await self.cluster.stop()           # leave the pool first: peers stop sending here
        if self.server is not None:
            n = self.server.in_flight
            log.info("draining %d in-flight requests (up to %s s)", n, self.cfg.node.drain_timeout)
            drained = await self.server.drain(self.cfg.node.drain_timeout)
            if not drained:
                log.warning("drain timeout: %d requests still in flight are dropped", self.server.in_flight)
            self.server.close_all()
            await asyncio.sleep(0)              # let connection_lost run (puts abort, leases release)
        if self._maint is not None:
            self._maint.cancel()
            try:
                await self._maint
            except asyncio.CancelledError:
                pass
        if self.store is not None:
            await self.store.close()            # closes the SSD tier: WAL committed, checkpoint written
        elif self.ssd is not None:
            await self.ssd.close()
        if self.router is not None:
            self.router.close()
        if self.residency is not None:
            self.residency.close()
        if self.metrics is not None:
            self.metrics.close()
        log.info("stopped%s", "" if drained else " (drain timed out)")
        return drained


def _unlink_stale_socket(path: str) -> None:
    """Remove a socket file left by a node that died; refuse (EADDRINUSE) if one answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"[node] unix_socket {path!r} exists and is not a socket: not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)                  # nobody listens: a stale file
        return
    finally:
        probe.close()
    raise OSError(98, f"another node listens on the Unix socket {path}")


# --------------------------------------------------------------------------- reload hooks
# How a SIGHUP applies each setting that the registry (config.SETTINGS) marks reloadable:
# exactly one hook per such setting (tests/test__sourcecode.py holds it), nothing else reloads.


def _reload_log_level(node: Node, value: Any, new: Config) -> None:
    logging.getLogger().setLevel(LOG_LEVELS[value])


def _read_where_used(node: Node, value: Any, new: Config) -> None:
    """Read from ``node.cfg`` each time it is used: the merged config is all it takes."""


def _reload_policy(node: Node, value: Any, new: Config) -> None:
    if value == "write_through" and node.ssd is None:
        raise ConfigError("write_through needs the SSD tier")
    node.store.policy = value


def _reload_watermarks(node: Node, value: Any, new: Config) -> None:
    node.store.low_watermark, node.store.high_watermark = new.store.low_watermark, new.store.high_watermark


def _reload_demote_after(node: Node, value: Any, new: Config) -> None:
    node.store.demote_after_s = value or None


def _reload_lease(node: Node, value: Any, new: Config) -> None:
    node.store.lease_s = float(value)


def _reload_put_timeout(node: Node, value: Any, new: Config) -> None:
    node.store.put_timeout_s = float(value)


def _reload_promote_on_get(node: Node, value: Any, new: Config) -> None:
    node.store.promote_on_get = bool(value)


def _reload_guard_mode(node: Node, value: Any, new: Config) -> None:
    from quillcache.store.guard import GUARD_MODES
    if value not in GUARD_MODES:
        raise ConfigError(f"guard mode {value!r}")
    if value == "off":
        log.warning("IDENTITY GUARD OFF: blocks are reused by content hash across models, "
                    "tokenizers, adapters and TENANTS")
    node.store.guard.mode = value


def _pin_quotas(tenants) -> tuple:
    """The store's hard-pin quotas from [[auth.tenants]]: (name, pin_bytes or None) each."""
    return tuple((t.name, t.pin_bytes) for t in tenants)


def _reload_auth(node: Node, value: Any, new: Config) -> None:
    server = node.server
    server.auth.configure(new.auth.tenants, new.auth.max_failed_hellos)
    node.store.set_pin_quotas(_pin_quotas(new.auth.tenants))
    closed = server.reauthorize()
    if server.auth.open_mode:
        log.warning("open mode (no tenants configured)")
    if closed:
        log.info("reload: closed %d connections of removed tenants", closed)


def _reload_hello_timeout(node: Node, value: Any, new: Config) -> None:
    node.server.hello_timeout = float(value)        # connections made from now on


def _reload_idle_timeout(node: Node, value: Any, new: Config) -> None:
    node.server.idle_timeout = float(value)         # the next sweep


def _reload_loopback_congestion(node: Node, value: Any, new: Config) -> None:
    node.server.loopback_congestion = str(value)    # connections made from now on


def _reload_commit_window(node: Node, value: Any, new: Config) -> None:
    if node.ssd is None:
        raise ConfigError("no SSD tier: the commit window applies to its WAL")
    node.ssd.set_commit_window(value)


RELOAD_HOOKS: dict[str, Callable[[Node, Any, Config], None]] = {
    "node.log_level": _reload_log_level,
    "node.drain_timeout": _read_where_used,
    "node.hello_timeout": _reload_hello_timeout,
    "node.idle_timeout": _reload_idle_timeout,
    "node.loopback_congestion": _reload_loopback_congestion,
    "wal.checkpoint_interval": _read_where_used,
    "store.policy": _reload_policy,
    "store.high_watermark": _reload_watermarks,
    "store.low_watermark": _reload_watermarks,
    "store.demote_after": _reload_demote_after,
    "store.lease": _reload_lease,
    "store.put_timeout": _reload_put_timeout,
    "ssd.promote_on_get": _reload_promote_on_get,
    "guard.mode": _reload_guard_mode,
    "auth.tenants": _reload_auth,
    "auth.max_failed_hellos": _reload_auth,
    "wal.commit_window": _reload_commit_window,
}


def _show(value: Any) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return "[" + ", ".join(str(v[0]) for v in value) + "]"      # tenants: names only
    return repr(value)


def _merge(old: Config, new: Config, applied: list[str]) -> Config:
    """The running config: ``old`` with the applied reloadable settings of ``new``."""
    if not applied:
        return old
    overrides = {}
    defaults = {s.qualname: s.default for s in SETTINGS}
    for qualname in applied:
        section, key = qualname.split(".", 1)
        overrides[qualname] = new.raw.get(section, {}).get(key, defaults[qualname])
    merged = old.with_overrides(overrides)
    merged.source = old.source
    return merged


# --------------------------------------------------------------------------- entry point


def _start_failure_code(exc: QuillCacheError) -> int:
    if isinstance(exc, (ConfigError, InvalidArgument)):   # InvalidArgument: a capacity or unit the data contradicts
        return exitcodes.CONFIG
    if isinstance(exc, Busy):                              # the data dir's lock is held
        return exitcodes.TEMPFAIL
    return exitcodes.DATAERR                                      # e.g. a corrupt SSD checkpoint


async def _main(cfg: Config, config_path: Optional[str], overrides: Mapping[str, Any]) -> int:
    node = Node(cfg, config_path=config_path, overrides=overrides)
    # Before start: a SIGINT/SIGTERM that lands while the node starts (its sockets already
    # listening) is a stop request kept for after start, not asyncio.Runner's own SIGINT
    # handler cancelling the start half way (which surfaced as click's "Aborted!", exit 1).
    node.install_signals(reload=False)
    try:
        await node.start()
    except QuillCacheError as exc:
        code = _start_failure_code(exc)
        hint = f" (another quillcached on data_dir {cfg.node.data_dir}?)" if code == exitcodes.TEMPFAIL else ""
        log.error("cannot start: %s%s", exc, hint)
        await node.stop()
        return code
    except OSError as exc:
        log.error("cannot start: %s", exc)
        await node.stop()
        return exitcodes.SOFTWARE if exc.errno not in (98, 13) else exitcodes.CONFIG   # EADDRINUSE, EACCES
    node.install_signals()
    await node.wait_stopped()
    await node.stop()
    return exitcodes.OK


def run(cfg: Config, *, config_path: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None) -> int:
    """Run the node in the foreground on uvloop until SIGTERM/SIGINT; returns the exit code."""
    import uvloop

    setup_logging(cfg.node.log_level)
    log.info("quillcached %s starting (pid %d, configuration %s)", __version__, os.getpid(), cfg.source)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(_main(cfg, config_path, dict(overrides or {})))
    from quillcache.transfer.nixl import exit_past_nixl
    return exit_past_nixl(code)         # NIXL 1.5.1 crashes in an ELF destructor at exit (transfer/nixl.py)
