"""The command-line front ends (click): quillcached, quillctl, quillcache-gateway,
quillcache-sim-engine.  Thin: the work is in the quillcache package."""
