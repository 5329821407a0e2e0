"""Engine connectors: one engine-agnostic core (core.py) and thin adapters per engine."""
