"""Engines from etcd: the gateway's view of the engines registered in the cluster.

With ``[cluster] enabled = true`` the gateway watches ``/quillcache/<cluster_id>/engines/``
(cluster/engines.py: ``EngineWatch``, the node membership's etcd thread) and applies every
new view on the event loop: an engine registered since is added (its router worker, its
KV-event consumer, its health), one whose record left (its registrant stopped, or its lease
expired) is removed, one whose record changed is replaced.  The config's
``[[gateway.engines]]`` stay whatever etcd says; a record with the id of one of them is
refused (the config wins), as is a record that is not a valid engine table or cannot serve
beside the others (another tokenizer for the same model, a role mix): each refusal is logged
once and listed by ``GET /quillcache/workers`` (``quillctl gateway``).

Only records signed with the pool's ``[cluster] credential`` are seen (docs/security.md):
one an etcd writer made up, signed with another credential, or copied under another engine's
key is refused by the watch (logged once per key and reason, counted in ``records_refused``),
never connected to.

While etcd cannot be reached the watch keeps its last view, so the gateway keeps routing to
the engines it knew; the state is ``degraded`` until etcd answers and the prefix is listed
again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from quillcache.cluster.keys import ClusterKeys
from quillcache.net import ConversionError
from quillcache.errors import InvalidArgument
from quillcache.gateway.settings import engine_of_record

__all__ = ["EngineDiscovery", "FIRST_VIEW_WAIT_S"]

log = logging.getLogger("quillcache.gateway")

FIRST_VIEW_WAIT_S = 3.0      # seconds the gateway waits at start for etcd's first view (then serves anyway)


class EngineDiscovery:
    def __init__(self, gateway) -> None:
        self.gw = gateway
        c = gateway.cfg.cluster
        self.endpoints = c.etcd
        self.cluster_id = c.cluster_id
        # Only keys derived from the credential are kept (cluster/keys.py): a record that they
        # do not sign, or that names another engine than its key, is refused by the watch.
        self._keys = ClusterKeys(c.credential, c.cluster_id)
        self.state = "starting"
        self.engines: set[str] = set()               # ids added from etcd and still served
        self.rejected: dict[str, str] = {}           # id -> why its record is not served
        self.added = self.removed = 0
        self._view: Optional[dict[str, Any]] = None
        self._wake = asyncio.Event()
        self._first = asyncio.Event()
        self._watch = None
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        from quillcache.cluster.engines import EngineWatch, etcd_client_missing
        missing = etcd_client_missing()
        if missing is not None:
            raise InvalidArgument(f"[cluster] enabled: {missing}")
        loop = asyncio.get_running_loop()
        self._watch = EngineWatch(endpoints=self.endpoints, cluster_id=self.cluster_id, loop=loop,
                                  on_change=self._on_change, keys=self._keys)
        self._watch.start()
        self._task = loop.create_task(self._run(), name="qc-gateway-discovery")
        try:
            await asyncio.wait_for(self._first.wait(), FIRST_VIEW_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("etcd at %s has not answered in %.0fs: serving the config's engines meanwhile",
                        ", ".join(f"{h}:{p}" for h, p in self.endpoints), FIRST_VIEW_WAIT_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._watch is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._watch.stop)

    def _on_change(self, view: dict[str, Any], state: str) -> None:
        """On the loop, from the watch thread: a new view (or the same one in a new state)."""
        if state != self.state:
            log.info("etcd engine view: %s", state)
        self.state = state
        self.gw.metrics.on_etcd_state(state)
        self._view = view
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._view is not None:
                await self.apply(self._view)
            if self.state == "ok":
                self._first.set()

    async def apply(self, view: dict[str, Any]) -> None:
        """Make the engines served from etcd those of ``view`` (id -> record or None)."""
        gw = self.gw
        static = {s.id for s in gw.cfg.gateway.engines}
        wanted, rejected = {}, {}
        for name in sorted(view):
            record = view[name]
            try:
                if record is None:
                    raise ConversionError(f"engine record {name!r} is not a JSON object")
                spec = engine_of_record(record, name)
            except ConversionError as exc:
                rejected[name] = str(exc)
                continue
            if name in static:
                rejected[name] = f"engine {name!r} is also in [[gateway.engines]]: the config's entry is served"
                continue
            wanted[name] = spec
        for eid in sorted(self.engines):
            state = gw.engines.get(eid)
            if state is None or wanted.get(eid) != state.spec:
                await gw.remove_engine(eid)
                self.engines.discard(eid)
                self.removed += 1
                log.info("engine %s left (etcd)", eid)
        for eid, spec in wanted.items():
            if eid in self.engines:
                continue
            try:
                gw.add_engine(spec, source="etcd")
            except InvalidArgument as exc:
                rejected[eid] = f"engine record {eid!r}: {exc}"
                continue
            self.engines.add(eid)
            self.added += 1
            log.info("engine %s joined (etcd): %s, model %s, role %s", eid, spec.url, spec.model, spec.role)
        for eid, why in rejected.items():
            if self.rejected.get(eid) != why:
                log.error("engine record not served: %s", why)
        self.rejected = rejected
        gw.metrics.etcd_engines.set(len(self.engines))
        gw.metrics.etcd_rejected.set(len(rejected))

    def status(self) -> dict:
        refused = self._watch.stats()["records_refused"] if self._watch is not None else 0
        return {"state": self.state, "cluster_id": self.cluster_id, "engines": sorted(self.engines),
                "rejected": dict(self.rejected), "added": self.added, "removed": self.removed,
                "records_refused": refused}
