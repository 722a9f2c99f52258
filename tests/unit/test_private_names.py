"""No module under bench/ or tests/ touches a private name of connector/ or kernels/, other than
the tests of that module (issue 34): a private name can change with its module, and whatever
reaches for one from outside breaks silently, or pins the module's insides.

A private name has one leading underscore (``__dunder__`` names are Python's). A module touches
one by importing it (``from turbowire.connector.x import _y``, or a private module such as
``turbowire.kernels._twcpu``), by reading, writing or deleting an attribute of that name
(``w.loader._jobs``, ``client._stub = ...``), or by naming it to ``getattr``/``setattr``/
``hasattr``/``delattr`` or ``monkeypatch.setattr``/``delattr``. Whose name it is: the module
named, where the code names one (an import from it; an attribute of a module, class or function
imported from it: ``cpu_binding._library``); otherwise, as an attribute's owner is not known
without running the code, every connector/ and kernels/ module that defines the name (a
function, class, method, variable, or an attribute it assigns), unless the touching module
defines it itself (its own classes' ``self._x``, its own helpers).

The tests of a module: a test module's subject is its file name without ``test_`` and without
its package's name (``tests/unit/connector/test_[connector_]<subject>.py``,
``tests/unit/test_{connector,kernels}_<subject>.py``); a product module's key is its path under
connector/ or kernels/ with ``_`` for ``/``, without ``.py`` (a package's ``__init__``: the
package's path). The test module may touch the private names of the modules whose key equals its
subject, is a prefix of it at a ``_`` (``test_scheduler_guards.py``: scheduler.py), or starts
with it and a ``_`` (``test_loader.py``: loader.py and the modules split out of it, loader_*.py;
``test_kernels_cpu.py``, the C codec's test: cpu_binding.py). Nothing else may: not the bench,
not tests/integration, tests/fuzz, tests/e2e or tests/support, not another module's test.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "kernels")  # turbowire.connector, turbowire.kernels
SCANNED = ("bench", "tests")
ATTR_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name.strip("_") != ""


def module_key(path: Path) -> str:
    """``connector/coder/cuda.py``: ``coder_cuda``; ``connector/coder/__init__.py``: ``coder``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts[1:])
    if parts and parts[-1] == "__init__":
        parts.pop()
    return "_".join(parts)


def definitions(tree: ast.AST, own_only: bool = False) -> set[str]:
    """The private names a module defines. ``own_only`` (a scanned module's): attribute
    assignments count only on ``self``/``cls`` (assigning ``client._stub`` defines nothing, it
    touches), and imports not at all."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if not own_only or (isinstance(node.value, ast.Name)
                                and node.value.id in ("self", "cls")):
                names.add(node.attr)
        elif isinstance(node, ast.arg) and own_only:
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not own_only:
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return {n for n in names if private(n)}


def product_privates() -> dict[str, set[str]]:
    """Private name -> keys of the connector/ and kernels/ modules that define it."""
    owners: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            key = f"{package}:{module_key(path)}"
            for name in definitions(ast.parse(path.read_text(), str(path))):
                owners[name].add(key)
    return owners


def subject(path: Path) -> tuple[str, str] | None:
    """(package, subject) of a dedicated unit test module, None for any other module."""
    rel = path.relative_to(REPO)
    if rel.parts[:2] != ("tests", "unit") or not rel.name.startswith("test_"):
        return None
    stem = rel.stem[len("test_"):]
    if rel.parts[2:3] == ("connector",) and len(rel.parts) == 4:
        return "connector", stem.removeprefix("connector_")
    for package in PACKAGES:
        if len(rel.parts) == 3 and stem.startswith(package + "_"):
            return package, stem[len(package) + 1:]
    return None


def is_test_of(test: tuple[str, str] | None, owner: str) -> bool:
    """Whether a test module of subject ``test`` is one of ``owner``'s tests."""
    if test is None:
        return False
    package, key = owner.split(":")
    test_package, name = test
    return package == test_package and (
        key == name or name.startswith(key + "_") or key.startswith(name + "_"))


def owner_of(dotted: str) -> str | None:
    """The key (``package:key``) of the connector/ or kernels/ module a dotted name is or is
    defined in (``turbowire.connector.loader.KVLoader``: ``connector:loader``); None for any
    other."""
    parts = dotted.split(".")
    if parts[0] == "turbowire":
        parts = parts[1:]
    if not parts or parts[0] not in PACKAGES:
        return None
    package, rest = parts[0], parts[1:]
    while rest:  # the longest prefix that is a module
        path = REPO.joinpath(package, *rest)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            break
        rest.pop()
    return f"{package}:{'_'.join(rest)}"


def touches(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """(line, private name, its module's key where the code says it: imported from it, or an
    attribute of a name imported from it; else None)."""
    bound: dict[str, str] = {}  # names bound to connector/ or kernels/ modules or their names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                owner = owner_of(f"{node.module}.{a.name}")
                if owner is not None:
                    bound[a.asname or a.name] = owner
        elif isinstance(node, ast.Import):
            for a in node.names:
                owner = owner_of(a.name)
                if owner is not None and a.asname:
                    bound[a.asname] = owner

    def base(value: ast.AST) -> str | None:
        return bound.get(value.id) if isinstance(value, ast.Name) else None

    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) and not node.level else ""
            for a in node.names:
                dotted = f"{module}.{a.name}" if module else a.name
                owner = owner_of(dotted)
                if owner is not None:
                    found += [(node.lineno, part, owner) for part in dotted.split(".")
                              if private(part)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            found.append((node.lineno, node.attr, base(node.value)))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else None
            if name not in ATTR_CALLS or not node.args:
                continue
            # setattr(obj, "_x", v) / monkeypatch.setattr(obj, "_x", v) /
            # monkeypatch.setattr("pkg.mod._x", v)
            target = node.args[0]
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                if isinstance(func, ast.Attribute) and private(target.value.rsplit(".", 1)[-1]):
                    found.append((node.lineno, target.value.rsplit(".", 1)[-1],
                                  owner_of(target.value)))
            elif len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and private(node.args[1].value):
                found.append((node.lineno, node.args[1].value, base(target)))
    return sorted(found, key=lambda t: t[:2])


def violations() -> list[str]:
    owners = product_privates()
    out: list[str] = []
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            own = definitions(tree, own_only=True)
            test = subject(path)
            for line, name, owner in touches(tree):
                if owner is not None:  # the code names its module
                    where = {owner} | owners.get(name, set())
                elif name in own or name not in owners:
                    continue  # the module's own, or no name of connector/ or kernels/
                else:
                    where = owners[name]
                if not any(is_test_of(test, key) for key in where):
                    out.append(f"{path.relative_to(REPO)}:{line}: {name} "
                               f"(of {', '.join(sorted(where))})")
    return out


def test_no_private_name_of_connector_or_kernels_outside_their_tests() -> None:
    found = violations()
    assert not found, (
        "private names of connector/ or kernels/ touched outside the tests of their module "
        "(use or add a public name; see this module's docstring for the rule):\n"
        + "\n".join(found))


def test_the_rule_exempts_a_modules_own_tests_only() -> None:
    """The test-module-to-module rule, on the file names it names."""
    def subj(rel: str) -> tuple[str, str] | None:
        return subject(REPO / rel)

    def may(rel: str, owner: str) -> bool:
        return is_test_of(subj(rel), owner)

    assert may("tests/unit/connector/test_loader.py", "connector:loader")
    assert may("tests/unit/connector/test_loader.py", "connector:loader_reads")
    assert may("tests/unit/connector/test_coder_cuda.py", "connector:coder_cuda")
    assert may("tests/unit/connector/test_connector_staging.py", "connector:staging")
    assert may("tests/unit/connector/test_scheduler_guards.py", "connector:scheduler")
    assert may("tests/unit/test_kernels_cpu.py", "kernels:cpu_binding")
    assert not may("tests/unit/connector/test_coder_cuda.py", "connector:loader")
    assert not may("tests/unit/connector/test_connector_staging.py",
                   "connector:sidechannel_client")
    assert not may("tests/unit/connector/test_store_keys.py", "connector:store_scheduler")
    assert not may("tests/unit/connector/test_loader.py", "kernels:loader")
    assert not may("tests/unit/test_kernels_cpu.py", "connector:cpu")
    for rel in ("tests/fuzz/targets.py", "tests/integration/test_connector_lease.py",
                "tests/support/fakes.py", "bench/gpu_path/rig.py", "tests/unit/test_stats.py"):
        assert subj(rel) is None, rel


def test_the_scan_sees_each_way_of_touching() -> None:
    code = '''
from turbowire.connector.loader import _Job, KVLoader
from turbowire.kernels import cpu_binding
import turbowire.kernels._twcpu
w.loader._jobs
client._stub = None
setattr(pool, "_leases", {})
monkeypatch.setattr(cpu_binding, "_library", None)
monkeypatch.setattr("turbowire.kernels.cpu_binding._library", None)
self._mine = 1
cpu_binding._library.cache_clear()
x.__dict__
'''
    got = touches(ast.parse(code))
    assert got == [(2, "_Job", "connector:loader"), (4, "_twcpu", "kernels:"),
                   (5, "_jobs", None), (6, "_stub", None), (7, "_leases", None),
                   (8, "_library", "kernels:cpu_binding"), (9, "_library", "kernels:cpu_binding"),
                   (10, "_mine", None), (11, "_library", "kernels:cpu_binding")], got
    assert definitions(ast.parse(code), own_only=True) == {"_mine"}
