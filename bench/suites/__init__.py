"""The asv suites (asv.conf.json's ``benchmark_dir``): asv imports every module in this folder
and nothing else, so a standalone script in bench/ that imports torch or an engine at module
level cannot break discovery.  A module here imports only what the project installs
(``.[test]``); tests/test_bench_discovery.py runs ``asv check`` on this folder in ``make test``.

asv imports this package under its folder's name with no repository root on ``sys.path``;
the root goes there so that the suites reach the standalone scripts' helpers (``bench.*``)
and the test fixtures (``tests._support``) by their absolute names.
"""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
