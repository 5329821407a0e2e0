"""The simulated engine (``quillcache-sim-engine``) and the trace replay.

Part of the tests and of the evaluation, never of the data path: ``engine`` is a pure
model of one engine's paged prefix cache and continuous batching, ``server`` puts it behind
an OpenAI-compatible HTTP API in real time, ``trace`` and ``replay`` drive many engines on a
virtual clock.
"""
