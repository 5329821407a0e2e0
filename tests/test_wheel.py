"""What an operator installs is a wheel, not an editable checkout: build one from this tree,
install it into an empty virtual environment, start ``quillcached`` from there and import every
subpackage of the product from there.

The new environment gets the wheel and nothing of this checkout.  Its third-party dependencies
(numpy, uvloop, ...) are borrowed from the test's own environment by a plain path entry (so the
test needs no network): a path added that way is searched for modules but its ``.pth`` files are
not run, so the editable install of the checkout that lives there stays invisible, and the test
checks that every ``quillcache`` module it imports comes from the wheel.
"""
from __future__ import annotations

import json
import os
import signal
import site
import socket
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from tests._support.daemon import START_TIMEOUT_S, base_toml
from tests._support.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 600     # the Cython extensions compile again unless build/ is warm
# Optional extras a module may need at import time; a module that fails only for one of these is
# reported as skipped by the extra, not as missing from the wheel.
OPTIONAL_IMPORTS = {"torch", "vllm", "sglang", "lmcache", "rocksdict", "nixl", "nixl_cu12"}
# Imported by name as well as found by the walk: an operator wires these from the docs.
MUST_IMPORT = ("quillcache.connectors.core", "quillcache.cluster.membership", "quillcache.cluster.hook",
               "quillcache.node.daemon", "quillcache.gateway.server", "quillcache.client.shm",
               "quillcache_cli.quillctl", "quillcache_cli.quillcached", "quillcache_cli.quillcache_gateway")

_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    optional, must = set(sys.argv[1].split(",")), sys.argv[2].split(",")
    names = set(must)
    for top in ("quillcache", "quillcache_cli"):
        pkg = importlib.import_module(top)
        names.add(top)
        names.update(m.name for m in pkgutil.walk_packages(pkg.__path__, top + "."))
    out = {"ok": {}, "optional": {}, "failed": {}}
    for name in sorted(names):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            kind = "optional" if (exc.name or "").split(".")[0] in optional else "failed"
            out[kind][name] = repr(exc)
        except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
            out["failed"][name] = repr(exc)
        else:
            out["ok"][name] = getattr(mod, "__file__", None) or ""
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(out.glob("quillcache-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    # its own pip: `pip install --prefix` from this environment would first uninstall this
    # environment's (editable) quillcache, since pip takes the running environment for the target
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout}\n{r.stderr}"
    # third-party dependencies from this environment: a plain path line (its .pth files do not run)
    Path(purelib, "zz_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return env_dir


def test_the_wheel_holds_every_package_of_the_source_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    # every folder of Python source under src/ is a package in the wheel (a folder without an
    # __init__.py would be a namespace package that package discovery leaves out)
    folders = sorted({str(p.parent.relative_to(ROOT / "src")) for p in (ROOT / "src").rglob("*.py")})
    missing = [f for f in folders if f"{f}/__init__.py" not in names]
    assert not missing, f"packages left out of the wheel: {missing}"
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    # every extension (one per _native/*.pyx, setup.py) is compiled into the wheel
    for pyx in sorted((ROOT / "src" / "quillcache" / "_native").glob("*.pyx")):
        assert any(n.startswith(f"quillcache/_native/{pyx.stem}.") and n.endswith(".so") for n in names), pyx.name


def test_every_subpackage_imports_from_the_installed_wheel(venv):
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-c", _IMPORT_ALL, ",".join(sorted(OPTIONAL_IMPORTS)), ",".join(MUST_IMPORT)],
                       capture_output=True, text=True, timeout=300, cwd=venv,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert not result["failed"], f"modules that do not import from the wheel: {result['failed']}"
    for name in MUST_IMPORT:
        assert name in result["ok"], (name, result["optional"].get(name))
    stray = {n: f for n, f in result["ok"].items() if f and not f.startswith(str(venv))}
    assert not stray, f"modules imported from outside the installed wheel: {stray}"
    print(f"\nwheel: {len(result['ok'])} modules import from {venv}; "
          f"{len(result['optional'])} need an optional extra: {sorted(result['optional'])}")


def test_quillcached_from_the_wheel_serves_a_put_and_a_get(venv, tmp_path):
    port, metrics_port = free_port(), free_port()
    conf = tmp_path / "quillcache.toml"
    conf.write_text(base_toml(port, metrics_port, tmp_path / "data"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(venv / "bin" / "quillcached"), "--config", str(conf)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "quillcached from the wheel did not listen"
                time.sleep(0.05)
        script = textwrap.dedent(f"""
            import quillcache
            from quillcache import Client, KvBlockKey
            key = KvBlockKey("m", "tok", None, "t", "p" * 16, "h" * 16)
            with Client("127.0.0.1:{port}") as c:
                c.put(key, b"from the wheel")
                assert c.get(key) == b"from the wheel"
            print(quillcache.__file__)
        """)
        r = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().startswith(str(venv))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")
