"""The shape of the source tree, read from the code's own imports (``ast``, nothing imported):
no import circle between modules, none between packages (an arrow running back up the layers
closes one), the library never imports its front ends, and no file past reading size."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 800       # STYLE.md: keep modules under ~800 lines, one concern each (Cython aside)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.with_suffix("").relative_to(SRC).parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of this tree that ``name`` imports, at module level or inside functions
    (a function-level import still ties the two together); ``if TYPE_CHECKING:`` aside."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _room(module: str) -> str:
    """A module's place in the layers: its package (``quillcache.store``) or, at the top, itself."""
    return ".".join(module.split(".")[:2])


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules():
    circles = _circles(_graph())
    assert not circles, "import circles between modules:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_import_runs_back_up_the_layers():
    """Between packages the imports form layers: a package that imports one that imports it back
    (directly or around a longer loop) is an arrow running back up."""
    rooms: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        rooms.setdefault(_room(module), set()).update(_room(t) for t in targets if _room(t) != _room(module))
    circles = _circles(rooms)
    detail = []
    for circle in circles:
        for module, targets in _graph().items():
            if _room(module) in circle:
                detail += [f"  {module} -> {t}" for t in sorted(targets)
                           if _room(t) in circle and _room(t) != _room(module)]
    assert not circles, f"packages importing each other: {circles}\n" + "\n".join(detail)


def test_the_wire_layer_and_the_library_import_no_front_end():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("quillcache.protocol"):
            assert not [t for t in targets if t.startswith(("quillcache.control", "quillcache.cluster",
                                                            "quillcache.node", "quillcache.gateway"))], module
        if module.startswith("quillcache.") or module == "quillcache":
            assert not [t for t in targets if t.startswith("quillcache_cli")], module


def test_no_source_file_is_past_reading_size():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along their seams): {long}"
