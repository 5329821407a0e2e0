"""Checks on the source tree itself (the asyncpg/uvloop ``test__sourcecode`` habit): the linter
passes, and the "one place for each thing" rules hold."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "quillcache"
CLI = ROOT / "src" / "quillcache_cli"
TESTS = ROOT / "tests"

# A behaviour suite that other backends re-run on their own fixture (not a helper).
SHARED_SUITES = {"tests.index.test_backends"}


def _ruff() -> str:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return str(exe)
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is in the [test] extra (pip install -e '.[test]')")
    return found


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_ruff_check_passes_on_the_whole_tree():
    r = subprocess.run([_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"ruff check found problems:\n{r.stdout}\n{r.stderr}"


def test_no_test_module_imports_another_test_module():
    """Shared test code lives in tests/_support/, never in a test file another one imports."""
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if name in SHARED_SUITES or any(name.startswith(m + ".") for m in SHARED_SUITES):
                    continue
                if parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts[1:]):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert not offenders, "\n".join(offenders)


# --------------------------------------------------------------------------- one place for each fact


def _int_assignments(path: Path) -> dict[str, int]:
    """Module-level ``NAME = <int literal>`` of ``path``."""
    out = {}
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and type(node.value.value) is int:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def test_exit_codes_are_defined_only_in_quillcache_exitcodes():
    from quillcache import exitcodes
    codes = {getattr(exitcodes, n) for n in exitcodes.__all__ if isinstance(getattr(exitcodes, n), int)}
    offenders = []
    for path in [*SRC.rglob("*.py"), *CLI.rglob("*.py")]:
        if path == SRC / "exitcodes.py":
            continue
        for name, value in _int_assignments(path).items():
            if name.startswith("EX_") or (path.name == "exitcodes.py" and value in codes):
                offenders.append(f"{path.relative_to(ROOT)}: {name} = {value}")
    assert not offenders, "exit codes belong in src/quillcache/exitcodes.py:\n" + "\n".join(offenders)


def test_no_test_skips_when_a_native_extension_or_the_ssd_tier_is_missing():
    """A broken build fails the store tests loudly instead of skipping them."""
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "importorskip" and node.args \
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("quillcache"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "\n".join(offenders)


def _constants(path: Path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Constant):
            yield node


def test_the_default_address_is_written_only_in_config():
    from quillcache.net import DEFAULT_ADDRESS
    offenders = [f"{p.relative_to(ROOT)}:{c.lineno}"
                 for p in [*SRC.rglob("*.py"), *CLI.rglob("*.py")] if p != SRC / "net.py"
                 for c in _constants(p) if c.value == DEFAULT_ADDRESS]
    assert not offenders, "use quillcache.net.DEFAULT_ADDRESS:\n" + "\n".join(offenders)


def test_the_client_timeout_default_is_defined_only_in_the_client():
    """quillctl's --timeout default is the client's DEFAULT_TIMEOUT_S, not a second copy."""
    offenders = []
    for path in [*SRC.rglob("*.py"), *CLI.rglob("*.py")]:
        if path == SRC / "client" / "calls.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id.startswith("DEFAULT_TIMEOUT") for t in node.targets):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "use quillcache.client.DEFAULT_TIMEOUT_S:\n" + "\n".join(offenders)


def test_the_longest_pin_is_defined_only_in_the_model():
    from quillcache.model import MAX_PIN_TTL_S
    offenders = []
    for path in [*SRC.rglob("*.py"), *CLI.rglob("*.py")]:
        if path == SRC / "model.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.BinOp, ast.Constant)):
                try:
                    value = ast.literal_eval(node.value) if isinstance(node.value, ast.Constant) \
                        else eval(compile(ast.Expression(node.value), "<expr>", "eval"), {"__builtins__": {}})
                except Exception:
                    continue
                if value == MAX_PIN_TTL_S:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "use quillcache.model.MAX_PIN_TTL_S:\n" + "\n".join(offenders)


def test_the_info_format_and_the_status_map_have_one_home():
    homes = {"render_info": SRC / "protocol" / "info.py", "parse_info": SRC / "protocol" / "info.py",
             "error_for_status": SRC / "errors.py"}
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and node.name in homes and homes[node.name] != path:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: def {node.name}")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "STATUS_CLASSES"
                                                    for t in node.targets) and path != SRC / "errors.py":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: STATUS_CLASSES =")
    assert not offenders, "\n".join(offenders)


def test_every_reloadable_setting_has_exactly_one_reload_hook_and_nothing_else_does():
    """A setting is declared reloadable once, in the registry; the daemon applies it through
    its one hook table (a reloadable setting without a hook, or a hook for a fixed one, fails)."""
    from quillcache.node.settings import SETTINGS
    from quillcache.node.daemon import RELOAD_HOOKS
    assert set(RELOAD_HOOKS) == {s.qualname for s in SETTINGS if s.reloadable}


# The hot paths and the front ends: server, client, daemon, the protocol package and the CLI.
HOT_PATHS = [*(SRC / "node").glob("*.py"), *(SRC / "client").glob("*.py"), *(SRC / "protocol").glob("*.py"),
             *CLI.glob("*.py")]


def _private_reaches(path: Path, root: Path = ROOT) -> list[str]:
    """``x._name`` / ``getattr(x, "_name")`` where ``x`` is not self, cls, super() or a class
    of the same module: one object driving another's private members."""
    tree = _tree(path)
    own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, base = node.args[1].value, node.args[0]
        else:
            continue
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in own_classes):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


# Friends by design: (folder under src/quillcache, private member) -> why the folder's modules may
# reach it on objects of each other's classes.  Nothing outside the folder may.
FRIENDS = {
    ("store", "_id"): "Lease (store/values.py) is the store's own handle: its lease id is the store's key",
    ("store", "_slot"): "Lease: the DRAM slot it pins, set and read by the store's modules only",
    ("store", "_pending"): "PutHandle (store/values.py): the pending put the store's write path drives",
    ("store", "_end_lease"): "Lease.release() ends itself in the store that made it (LocalKvStore's mixins)",
}


def _friend(line: str) -> bool:
    path = line.split(":")[0]
    folder = Path(path).relative_to("src/quillcache").parts[0] if path.startswith("src/quillcache/") else ""
    return (folder, line.rsplit(".", 1)[-1]) in FRIENDS


def test_no_module_touches_another_objects_private_members():
    """All of src/ (the hot paths included), less the short list of friends above."""
    offenders = [line for path in [*SRC.rglob("*.py"), *CLI.rglob("*.py")] for line in _private_reaches(path)
                 if not _friend(line)]
    assert not offenders, "use (or add) a public call:\n" + "\n".join(offenders)


def test_every_friend_is_still_needed():
    """An allowlist entry that no code uses any more goes: the list stays short and true."""
    used = {(Path(line.split(":")[0]).relative_to("src/quillcache").parts[0], line.rsplit(".", 1)[-1])
            for path in SRC.rglob("*.py") for line in _private_reaches(path) if _friend(line)}
    assert set(FRIENDS) <= used, f"unused entries: {sorted(set(FRIENDS) - used)}"


def test_the_residency_index_modules_use_only_public_calls_of_each_other():
    """index/: the persistent index, its log codec and lazy maps reach the tree (art.py) and
    the checkpoint (checkpoint.py) through public calls (add_block, block_hash, is_warm)."""
    offenders = [line for path in (SRC / "index").glob("*.py") for line in _private_reaches(path)]
    offenders += [f"{path.relative_to(ROOT)}: imports {a.name}" for path in (SRC / "index").glob("*.py")
                  for node in ast.walk(_tree(path)) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").startswith("quillcache.index") for a in node.names
                  if a.name.startswith("_")]
    assert not offenders, "use (or add) a public call:\n" + "\n".join(offenders)


def test_the_private_member_check_sees_what_it_must(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(conn, ssd):\n    conn._pending.pop(1)\n    return getattr(ssd, '_committer')\n")
    assert len(_private_reaches(sample, tmp_path)) == 2


def test_the_server_and_client_do_not_pack_or_slice_request_bodies_by_hand():
    """The GET/PUT bodies are the codec's (encode/decode_key_body, _put_body): no u16/u64
    structs or byte-index arithmetic on a frame header in the server or the client."""
    offenders = []
    for path in [*(SRC / "node").glob("*.py"), *(SRC / "client").glob("*.py")]:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and node.value in ("<H", "<Q", "<HQ"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: struct {node.value!r}")
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("hdr", "header", "body"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)
