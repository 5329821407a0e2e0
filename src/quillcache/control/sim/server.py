"""The simulated engine behind an OpenAI-compatible HTTP API, in real time (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` gives
server-sent events, one chunk per token, then ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /sim/stats`` (the engine's counters, as JSON, for tests) and ``GET /metrics``
(its KV memory as vLLM says it: ``vllm:cache_config_info``).

Tokens: a prompt string is UTF-8 bytes, one token per byte (``tokenize``), so anyone (the
gateway, a test) computes the same token ids; a prompt may also be a list of token ids, as
the OpenAI API allows.  Chat messages are rendered by ``render_chat`` first.  Output tokens
are words of a fixed list, chosen by position.

Identity: the request's ``model`` names the base model or one of the served LoRA adapters
(vLLM's naming; SGLang's ``base:adapter`` and ``lora_path`` field are understood too);
the tenant is vLLM's ``cache_salt`` body field, else the ``X-Tenant-Id`` header, else none.

Disaggregated serving, as vLLM's NixlConnector speaks it: a request whose
``kv_transfer_params`` has ``do_remote_decode`` is a prefill for another engine; its answer
carries ``kv_transfer_params`` (``do_remote_prefill``, ``remote_engine_id``,
``remote_block_ids`` = one id per prompt block, ``remote_host``, ``remote_port``).  A request
that brings those back (``do_remote_prefill``) loads the named prompt blocks instead of
computing them (``SimRequest.remote_blocks``).

The engine loop (``EngineRunner``) runs one iteration at a time: it plans, sleeps until the
iteration's modelled end, applies it, then wakes the requests that got tokens and hands the KV
events to the ``on_events`` callback (the ZMQ publisher).  Client disconnects abort between
iterations.

Its clock does not drift: while the engine runs back to back, the next iteration starts at the
modelled end of the last one (as a GPU's would), not at the moment this process got round to
planning it, so the loop's own Python work (applying a step, publishing events, streaming
tokens, a core shared with other processes) does not slow the modelled GPU down; a request that
arrived in that gap moves the start to its arrival (no step includes a request before it came).
A loop that falls more than ``MAX_LATE_US`` behind starts again from the wall clock.
``/sim/stats`` reports how late the loop ran (``late_us`` in all, ``late_max_us``) and the
modelled time given up by restarting (``slipped_us``): a replay whose engines slipped did not
run the modelled GPU.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from aiohttp import web

from quillcache.control.sim.engine import (
    EngineConfig, SimEngine, SimEngineError, SimPool, SimRequest, StepResult, chain_hashes,
)
from quillcache.control import chat
from quillcache.model import IdentityScope

__all__ = ["EngineRunner", "SimServerConfig", "build_app", "tokenize", "render_chat", "start_server",
           "serve_forever", "Listening",
           "block_contents", "TENANT_HEADER", "OUTPUT_WORDS"]

log = logging.getLogger("quillcache.sim")

MAX_LATE_US = 1_000_000          # modelled us the engine loop may run behind before it restarts its clock

TENANT_HEADER = "X-Tenant-Id"
MAX_BODY_BYTES = 8 << 20            # bytes of request JSON
DEFAULT_MAX_TOKENS = 16
OUTPUT_WORDS = ("the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def render_chat(messages: object) -> str:
    """The gateway's own rendering (``quillcache.control.chat``), with this engine's error."""
    return chat.render_chat(messages, error=SimEngineError)


def block_contents(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The content bytes of each full block (token ids as 4-byte big-endian)."""
    full = len(tokens) // block_size
    return [b"".join(t.to_bytes(4, "big") for t in tokens[i * block_size:(i + 1) * block_size])
            for i in range(full)]


@dataclass
class SimServerConfig:
    model: str = "sim-model"
    tokenizer: str = "sim-bytes"        # the tokenizer identity: UTF-8 bytes (``tokenize``)
    adapters: tuple[str, ...] = ()
    max_model_len: int = 32768          # prompt + max_tokens, tokens
    time_scale: float = 1.0             # wall-clock seconds per modelled second
    # Publish the quill_scope identity extension in BlockStored.  Off by default: a real vLLM
    # engine's events say nothing of tenants, and the gateway is tested against that.
    identity_events: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_id: str = ""                 # remote_engine_id in kv_transfer_params ("": a random one)
    pool: Optional[SimPool] = None      # a shared KV pool (connectors/sim.py: a real node), or none


class _Pending:
    """A request in flight: the engine's record plus how the HTTP side waits on it."""

    __slots__ = ("sim", "event", "sent", "aborted")

    def __init__(self, sim: SimRequest) -> None:
        self.sim = sim
        self.event = asyncio.Event()
        self.sent = 0
        self.aborted = False


class EngineRunner:
    """Drives one ``SimEngine`` on the event loop's clock."""

    def __init__(self, engine: SimEngine,
                 on_events: Optional[Callable[[StepResult], None]] = None,
                 time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise SimEngineError(f"time_scale {time_scale!r}: must be > 0")
        self.engine = engine
        self.time_scale = time_scale
        self.on_events = on_events
        self._pending: dict[int, _Pending] = {}
        self._wake = asyncio.Event()
        self._aborts: list[_Pending] = []
        self._task: Optional[asyncio.Task] = None
        self._t0 = time.monotonic()
        self._last_submit_us = 0
        self.steps = 0
        self.late_us = 0                 # wall lag of back-to-back iterations behind their modelled start
        self.late_max_us = 0
        self.slipped_us = 0              # modelled time given up when the loop fell MAX_LATE_US behind

    def now_us(self) -> int:
        """Modelled microseconds since start (wall time divided by the time scale)."""
        return int((time.monotonic() - self._t0) * 1e6 / self.time_scale)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, sim: SimRequest) -> _Pending:
        sim.arrival_us = self._last_submit_us = self.now_us()
        self.engine.submit(sim)         # raises SimEngineError before anything is held
        p = _Pending(sim)
        self._pending[id(sim)] = p
        self._wake.set()
        return p

    def abort(self, p: _Pending) -> None:
        if p.sim.state != "finished" and not p.aborted:
            p.aborted = True
            self._aborts.append(p)
            self._wake.set()

    def _start_us(self, end: Optional[int]) -> int:
        """When the next iteration starts, in modelled us: now after idling; back to back, the
        last one's end, or the newest arrival since (a step never includes a request before it
        came); now again when the loop is more than MAX_LATE_US behind."""
        now = self.now_us()
        if end is None or end >= now:
            return now if end is None else end
        late = now - end
        if late > MAX_LATE_US:
            self.slipped_us += late
            return now
        self.late_us += late
        self.late_max_us = max(self.late_max_us, late)
        return max(end, self._last_submit_us)

    async def _run(self) -> None:
        eng = self.engine
        end: Optional[int] = None            # modelled end of the last iteration (None: idle since)
        while True:
            for p in self._aborts:
                if p.sim.state != "finished":
                    eng.abort(p.sim, self.now_us())
                self._pending.pop(id(p.sim), None)
            self._aborts.clear()
            start = self._start_us(end)
            plan = eng.plan_step(start)
            if plan is None:
                end = None
                self._wake.clear()
                await self._wake.wait()
                continue
            end = start + plan.duration_us
            await asyncio.sleep(max(0.0, self._t0 + end / 1e6 * self.time_scale - time.monotonic()))
            res = eng.finish_step()
            self.steps += 1
            if self.on_events is not None and (res.stored or res.removed):
                try:
                    self.on_events(res)
                except Exception:               # a publisher fault must not stop the engine
                    log.exception("publishing KV events failed")
            for p in self._pending.values():
                if p.sim.state in ("decode", "finished"):
                    p.event.set()
            for sim in res.finished:
                self._pending.pop(id(sim), None)


# --------------------------------------------------------------------------- HTTP


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


def _output_text(start: int, end: int) -> str:
    return "".join(OUTPUT_WORDS[i % len(OUTPUT_WORDS)] for i in range(start, end))


class _Api:
    def __init__(self, cfg: SimServerConfig, runner: EngineRunner) -> None:
        self.cfg = cfg
        self.runner = runner
        self.created = int(time.time())
        self.served = {cfg.model: None, **{a: a for a in cfg.adapters}}
        self.engine_id = cfg.engine_id or uuid.uuid4().hex

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "quillcache-sim",
                 "root": self.cfg.model, "parent": None if adapter is None else self.cfg.model}
                for name, adapter in self.served.items()]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        """As vLLM's /metrics says its KV memory: the info gauge vllm:cache_config_info (its
        labels the cache config: pages and their size), which a gateway reads
        ([router] learn_kv_blocks)."""
        c = self.runner.engine.config
        text = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{c.block_size}",engine="0",'
                f'num_gpu_blocks="{c.capacity_blocks}"}} 1.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def stats(self, request: web.Request) -> web.Response:
        e = self.runner.engine
        now = self.runner.now_us()        # one instant for both clock fields
        return web.json_response({
            "model": self.cfg.model, "block_size": e.config.block_size,
            "capacity_blocks": e.config.capacity_blocks, "used_blocks": e.used_blocks,
            "cached_blocks": len(e.resident()), "running": e.running, "waiting": e.waiting,
            "steps": self.runner.steps, "prompt_tokens": e.prompt_tokens_total,
            "hit_tokens": e.hit_tokens_total, "pool_tokens": e.pool_tokens_total,
            "remote_tokens": e.remote_tokens_total, "aborted": e.aborted,
            "busy_us": e.busy_us, "prefill_busy_us": e.prefill_busy_us, "now_us": now,
            "prefill_busy_now_us": e.prefill_busy_at(now),
            "cross_identity_hits": e.cross_identity_hits, "late_us": self.runner.late_us,
            "late_max_us": self.runner.late_max_us, "slipped_us": self.runner.slipped_us,
        })

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    @staticmethod
    def _transfer(body: dict, n_tokens: int, bs: int) -> tuple[bool, int]:
        """(a prefill for a remote decode?, prompt blocks to load from the prefill engine)."""
        params = body.get("kv_transfer_params")
        if params is None:
            return False, 0
        if not isinstance(params, dict):
            raise SimEngineError("kv_transfer_params must be an object")
        if params.get("do_remote_decode"):
            return True, 0
        if not params.get("do_remote_prefill"):
            return False, 0
        ids = params.get("remote_block_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise SimEngineError("kv_transfer_params.remote_block_ids must be a list of block ids")
        if len(ids) > -(-n_tokens // bs):
            raise SimEngineError(f"kv_transfer_params.remote_block_ids names {len(ids)} blocks; the "
                                 f"prompt has {-(-n_tokens // bs)}")
        return False, len(ids)

    def _parse(self, request: web.Request, body: object, chat: bool) -> tuple[SimRequest, bool, bool]:
        if not isinstance(body, dict):
            raise SimEngineError("the body must be a JSON object")
        model = body.get("model", self.cfg.model)
        if isinstance(model, str) and model not in self.served and ":" in model:
            base, adapter = model.rsplit(":", 1)          # SGLang's "base:adapter"
            if base == self.cfg.model and adapter in self.cfg.adapters:
                model = adapter
        if model not in self.served:
            raise LookupError(f"model {model!r} is not served (served: {', '.join(self.served)})")
        lora = body.get("lora_path")                      # SGLang's adapter field
        if lora is not None:
            if lora not in self.cfg.adapters:
                raise LookupError(f"adapter {lora!r} is not served")
            model = lora
        if chat:
            tokens = tokenize(render_chat(body.get("messages")))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]              # a batch of one
            if isinstance(prompt, str):
                tokens = tokenize(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                  and 0 <= t < (1 << 32) for t in prompt):
                tokens = list(prompt)
            else:
                raise SimEngineError("prompt must be a string, or a list of token ids (0..2^32-1)")
        if not tokens:
            raise SimEngineError("the prompt is empty")
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = body.get(key, DEFAULT_MAX_TOKENS)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise SimEngineError(f"{key} {max_tokens!r}: must be an integer >= 1")
        if len(tokens) + max_tokens > self.cfg.max_model_len:
            raise SimEngineError(f"prompt of {len(tokens)} tokens + {key} {max_tokens} exceeds "
                                 f"the model's length of {self.cfg.max_model_len}")
        tenant = body.get("cache_salt") or request.headers.get(TENANT_HEADER, "")
        if not isinstance(tenant, str):
            raise SimEngineError("cache_salt must be a string")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise SimEngineError("stream must be a boolean")
        opts = body.get("stream_options") or {}
        usage_in_stream = bool(isinstance(opts, dict) and opts.get("include_usage"))
        identity = IdentityScope(self.cfg.model, self.cfg.tokenizer, self.served[model], tenant)
        bs = self.runner.engine.config.block_size
        prefill_only, remote = self._transfer(body, len(tokens), bs)
        hashes = chain_hashes(identity, block_contents(tokens, bs))
        sim = SimRequest(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", identity,
                         len(tokens), hashes, max_tokens,
                         block_tokens=lambda i, t=tokens: t[i * bs:(i + 1) * bs],
                         tag=(model, prefill_only), remote_blocks=remote)
        return sim, stream, usage_in_stream

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        try:
            sim, stream, usage_in_stream = self._parse(request, body, chat)
            pending = self.runner.submit(sim)
        except LookupError as exc:
            return _error(404, str(exc), "NotFoundError")
        except SimEngineError as exc:
            return _error(400, str(exc))
        try:
            if stream:
                return await self._stream(request, pending, chat, usage_in_stream)
            while sim.state != "finished":
                pending.event.clear()
                await pending.event.wait()
        except BaseException:
            self.runner.abort(pending)
            raise
        text = _output_text(0, sim.max_tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length", "logprobs": None} if chat else
                  {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
        doc = {"id": sim.request_id, "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": sim.tag[0], "choices": [choice],
               "usage": self._usage(sim)}
        if sim.tag[1]:                          # a prefill for a remote decode: where its KV is
            bs = self.runner.engine.config.block_size
            doc["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(range(-(-sim.prompt_tokens // bs))),
                "remote_host": request.url.host, "remote_port": request.url.port, "tp_size": 1}
        return web.json_response(doc)

    def _usage(self, sim: SimRequest) -> dict:
        bs = self.runner.engine.config.block_size
        return {"prompt_tokens": sim.prompt_tokens, "completion_tokens": sim.max_tokens,
                "total_tokens": sim.prompt_tokens + sim.max_tokens,
                "prompt_tokens_details": {"cached_tokens": sim.hit_blocks * bs,
                                          "pool_tokens": sim.pool_blocks * bs}}

    async def _stream(self, request: web.Request, p: _Pending, chat: bool,
                      usage_in_stream: bool) -> web.StreamResponse:
        sim = p.sim
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage: Optional[dict] = None) -> bytes:
            doc = {"id": sim.request_id, "object": obj, "created": created, "model": sim.tag[0],
                   "choices": choices}
            if usage is not None:
                doc["usage"] = usage
            return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]))
        while True:
            done = sim.state == "finished"
            upto = sim.generated(self.runner.engine.step_index)
            while p.sent < upto:
                i = p.sent
                p.sent += 1
                last = p.sent == sim.max_tokens
                text = _output_text(i, i + 1)
                fin = "length" if last else None
                c = ({"index": 0, "delta": {"content": text}, "finish_reason": fin} if chat else
                     {"index": 0, "text": text, "finish_reason": fin, "logprobs": None})
                await resp.write(chunk([c]))
            if done:
                break
            p.event.clear()
            await p.event.wait()
        if usage_in_stream:
            await resp.write(chunk([], self._usage(sim)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def build_app(cfg: SimServerConfig, runner: EngineRunner) -> web.Application:
    api = _Api(cfg, runner)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/sim/stats", api.stats)
    app.router.add_get("/metrics", api.metrics)

    async def on_startup(app: web.Application) -> None:
        runner.start()

    async def on_cleanup(app: web.Application) -> None:
        await runner.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


# --------------------------------------------------------------------------- running it


@dataclass
class Listening:
    """Where a started server is: the HTTP base URL and the event endpoints (or None)."""

    http: str
    events: Optional[str]
    replay: Optional[str]

    def ready_line(self) -> str:
        return f"READY http={self.http} events={self.events or '-'} replay={self.replay or '-'}"


async def start_server(cfg: SimServerConfig, host: str = "127.0.0.1", port: int = 0,
                       events_endpoint: Optional[str] = None,
                       replay_endpoint: Optional[str] = None,
                       topic: str = "") -> tuple[web.AppRunner, Listening, Callable[[], None]]:
    """Start the HTTP server (and the KV-event publisher when ``events_endpoint`` is given)
    on the running loop.  Returns the aiohttp runner, the addresses, and a close function
    for the publisher; port 0 binds a free port."""
    from quillcache.control.events import EventPublisher
    from quillcache.control.sim.kvevents import step_events

    publisher = None
    if events_endpoint is not None:
        publisher = EventPublisher(events_endpoint, replay_endpoint, topic=topic)
    engine = SimEngine(cfg.engine, cfg.pool)
    bs = cfg.engine.block_size

    def on_events(res: StepResult) -> None:
        if publisher is not None:
            publisher.publish(step_events(res, bs, identity=cfg.identity_events))

    runner = EngineRunner(engine, on_events, cfg.time_scale)
    app = build_app(cfg, runner)
    web_runner = web.AppRunner(app, access_log=None)
    await web_runner.setup()
    site = web.TCPSite(web_runner, host, port)
    await site.start()
    bound = web_runner.addresses[0][:2]                  # the port actually bound
    listening = Listening(f"http://{bound[0]}:{bound[1]}",
                          publisher.endpoint if publisher else None,
                          publisher.replay_endpoint if publisher else None)

    def close_publisher() -> None:
        if publisher is not None:
            publisher.close()

    return web_runner, listening, close_publisher


def serve_forever(cfg: SimServerConfig, host: str, port: int, events_endpoint: Optional[str],
                  replay_endpoint: Optional[str], topic: str = "",
                  announce: Callable[[str], None] = print,
                  on_listening: Optional[Callable[[Listening], Callable[[], None]]] = None) -> None:
    """Run until SIGINT/SIGTERM on uvloop; ``announce`` gets the READY line once bound.
    ``on_listening(listening)`` runs once bound (registering the engine in etcd) and returns
    what to call at the stop, before the server closes (withdrawing it)."""
    import signal

    import uvloop

    async def main() -> None:
        web_runner, listening, close_publisher = await start_server(
            cfg, host, port, events_endpoint, replay_endpoint, topic)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        withdraw = None
        try:
            if on_listening is not None:
                withdraw = on_listening(listening)
            announce(listening.ready_line())
            await stop.wait()
        finally:
            if withdraw is not None:        # first: routers stop sending before the server closes
                await loop.run_in_executor(None, withdraw)
            await web_runner.cleanup()
            close_publisher()

    uvloop.run(main())
