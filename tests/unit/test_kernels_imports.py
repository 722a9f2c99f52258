"""The import graph of kernels/ (parsed, not imported): no cycle, one front door, no upward imports.

Every import statement counts, also those inside functions and under ``TYPE_CHECKING``: a lazy
import that closes a circle is still a circle. The importing of a submodule's parent package is
not counted (Python runs ``kernels/__init__.py`` first for every submodule); importing a *name*
from the package (``from turbowire.kernels import EncodeItem``) is an edge to ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml's package-dir: import name -> source folder
PACKAGES = {"turbowire.kernels": ROOT / "kernels", "turbowire.codec": ROOT / "codec"}
KERNELS = "turbowire.kernels"


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGES[package].glob("*.py")):
        out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _statements(module: str, path: Path) -> list[tuple[str, str | None]]:
    """Every import of ``path`` as (absolute module, name or None): ``import a.b`` is
    ("a.b", None), ``from a import b`` (or its relative form) is ("a", "b")."""
    is_pkg = path.stem == "__init__"
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_pkg else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.extend((base, alias.name) for alias in node.names)
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every module name an import of ``path`` may refer to: for ``from a import b`` both ``a``
    and ``a.b`` (the callers keep whichever is a module)."""
    names: set[str] = set()
    for base, name in _statements(module, path):
        names.add(base)
        if name is not None:
            names.add(f"{base}.{name}")
    return names


def _kernel_graph() -> dict[str, set[str]]:
    mods = _modules(KERNELS)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        edges = set()
        for base, name in _statements(mod, path):
            target = base if name is None else f"{base}.{name}"
            if target in mods:
                edges.add(target)
            elif base in mods:  # a name defined in that module (or the package's __init__)
                edges.add(base)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_is_parsed() -> None:
    """Guards the checks below against passing on an empty graph."""
    graph = _kernel_graph()
    assert f"{KERNELS}.dispatch" in graph[KERNELS]
    assert {f"{KERNELS}.items", f"{KERNELS}.triton_launch", f"{KERNELS}.cpu_binding"} <= graph[
        f"{KERNELS}.dispatch"
    ]
    assert f"{KERNELS}.items" in graph[f"{KERNELS}.cpu_binding"]
    assert f"{KERNELS}.items" in graph[f"{KERNELS}.triton_launch"]


def test_cycle_finder() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_kernels_have_no_import_cycle() -> None:
    cycle = _find_cycle(_kernel_graph())
    assert cycle is None, "import cycle in kernels/: " + " -> ".join(cycle or [])


def test_only_the_package_imports_the_front_door() -> None:
    front = f"{KERNELS}.dispatch"
    importers = sorted(m for m, edges in _kernel_graph().items() if front in edges)
    assert importers == [KERNELS], f"{importers} import kernels/dispatch.py"


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for mod, path in _modules(package).items():
        for name in sorted(_imports(mod, path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_kernels_do_not_import_the_connector() -> None:
    assert _offenders(KERNELS, ("turbowire.connector",)) == []


def test_codec_imports_neither_kernels_nor_connector() -> None:
    assert _offenders("turbowire.codec", ("turbowire.kernels", "turbowire.connector")) == []



def _exported(package: str) -> set[str]:
    """The names in ``package``'s ``__all__`` (parsed)."""
    tree = ast.parse(_modules(package)[package].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def test_the_connector_imports_the_kernels_package_and_nothing_below_it() -> None:
    """``turbowire.kernels`` is the connector's one door to the kernels: no connector module
    (connector/coder/ and the other subfolders included) imports a module below it, by path
    (``turbowire.kernels.triton_plans``) or as a name of the package that is not exported."""
    public = _exported(KERNELS)
    assert {"ChunkSet", "cuda_serves", "EncodeLayersPlan"} <= public
    bad = []
    paths = sorted((ROOT / "connector").rglob("*.py"))
    assert any(p.parent.name == "coder" for p in paths)  # the walk reaches the subfolders
    for path in paths:
        rel = path.relative_to(ROOT / "connector").with_suffix("")
        parts = ["turbowire.connector", *rel.parts]
        module = ".".join(parts[:-1] if rel.name == "__init__" else parts)
        for base, name in _statements(module, path):
            below = base.startswith(KERNELS + ".")
            hidden = base == KERNELS and name is not None and name not in public
            if below or hidden:
                bad.append(f"{path.relative_to(ROOT)} imports {base}" + (f".{name}" if name
                                                                          else ""))
    assert bad == []
