"""No pickle on a network path (issue 17): the package source never deserialises with pickle or
anything else that runs code on load.

An ``ast`` walk over every module of the package (the directories pyproject.toml maps in
``[tool.setuptools] package-dir``) flags, with file:line:

* imports and calls of ``pickle``, ``cPickle``, ``_pickle``, ``dill``, ``cloudpickle``,
  ``shelve``, ``jsonpickle``, ``joblib`` (and ``__import__`` / ``importlib.import_module`` of
  them);
* ``marshal.load`` / ``marshal.loads``;
* ``torch.load`` (and ``torch.serialization.load``) without ``weights_only=True``;
* ``numpy.load`` with ``allow_pickle`` anything but a literal ``False``;
* ``yaml.load`` / ``yaml.load_all`` without ``Loader=SafeLoader`` (or CSafeLoader / BaseLoader),
  ``yaml.unsafe_load`` / ``yaml.unsafe_load_all`` / ``yaml.full_load`` / ``yaml.full_load_all``;
* ``pandas.read_pickle``;
* builtin ``eval`` / ``exec`` of anything but a string literal.

``ALLOWED`` is the reviewed exception list: (path, line text, reason) per entry. It is empty
today; an entry must still match a finding, so the list cannot outlive the code it excuses.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "jsonpickle",
                  "joblib"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}

# (path relative to the repo, the flagged line's text stripped, why it is safe)
ALLOWED: list[tuple[str, str, str]] = []


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    text: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}: {self.text}"


def package_dirs(repo: Path = REPO) -> list[Path]:
    """The source directories of the package, as pyproject.toml maps them."""
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    mapped = data["tool"]["setuptools"]["package-dir"]
    return sorted({repo / d for d in mapped.values()})


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class _Walker(ast.NodeVisitor):
    def __init__(self, path: str, lines: list[str]) -> None:
        self.path = path
        self.lines = lines
        self.aliases: dict[str, str] = {}  # local name -> qualified name it was imported as
        self.found: list[Finding] = []

    def _flag(self, node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.found.append(Finding(self.path, line, text, what))

    def _qualified(self, node: ast.AST) -> str | None:
        name = _dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        base = self.aliases.get(head, head)
        return f"{base}.{rest}" if rest else base

    # -- imports ----------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] in BANNED_MODULES:
                self._flag(node, f"imports {a.name}")
            self.aliases[(a.asname or a.name).split(".")[0]] = (
                a.name if a.asname else a.name.split(".")[0])
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if mod.split(".")[0] in BANNED_MODULES:
            self._flag(node, f"imports from {mod}")
        for a in node.names:
            if mod == "" and a.name in BANNED_MODULES:
                self._flag(node, f"imports {a.name}")
            self.aliases[a.asname or a.name] = f"{mod}.{a.name}" if mod else a.name
        self.generic_visit(node)

    # -- calls ------------------------------------------------------------------------
    @staticmethod
    def _kw(node: ast.Call, name: str) -> ast.expr | None:
        return next((k.value for k in node.keywords if k.arg == name), None)

    @staticmethod
    def _is_const(node: ast.expr | None, value: object) -> bool:
        return isinstance(node, ast.Constant) and node.value is value

    def visit_Call(self, node: ast.Call) -> None:
        q = self._qualified(node.func)
        is_builtin = isinstance(node.func, ast.Name) and node.func.id not in self.aliases
        if q and q.split(".")[0] in BANNED_MODULES:
            self._flag(node, f"calls {q}")
        elif q in ("marshal.load", "marshal.loads"):
            self._flag(node, f"calls {q}")
        elif q in ("torch.load", "torch.serialization.load"):
            if not self._is_const(self._kw(node, "weights_only"), True):
                self._flag(node, f"calls {q} without weights_only=True")
        elif q in ("numpy.load",):
            allow = self._kw(node, "allow_pickle")
            if allow is not None and not self._is_const(allow, False):
                self._flag(node, "calls numpy.load with allow_pickle")
        elif q in ("yaml.load", "yaml.load_all"):
            loader = self._kw(node, "Loader")
            if loader is None and len(node.args) >= 2:
                loader = node.args[1]
            name = (_dotted(loader) or "").rsplit(".", 1)[-1] if loader is not None else ""
            if name not in SAFE_YAML_LOADERS:
                self._flag(node, f"calls {q} without a safe Loader")
        elif q in ("yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load",
                   "yaml.full_load_all", "pandas.read_pickle"):
            self._flag(node, f"calls {q}")
        elif q in ("__import__", "importlib.import_module"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in BANNED_MODULES:
                self._flag(node, f"imports {arg.value} dynamically")
        elif is_builtin and q in ("eval", "exec"):
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                self._flag(node, f"calls {q} on a non-literal")
        self.generic_visit(node)


def scan_file(path: Path, root: Path = REPO) -> list[Finding]:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    walker = _Walker(rel, text.splitlines())
    walker.visit(ast.parse(text, filename=str(path)))
    return walker.found


def scan(dirs: list[Path], root: Path = REPO) -> list[Finding]:
    found: list[Finding] = []
    for d in dirs:
        for path in sorted(d.rglob("*.py")):
            found.extend(scan_file(path, root))
    return found


def _allowed(f: Finding) -> bool:
    return any(f.path == p and f.text == t for p, t, _ in ALLOWED)


def test_package_dirs_come_from_pyproject():
    dirs = {d.relative_to(REPO).as_posix() for d in package_dirs()}
    assert {"turbowire", "codec", "kernels", "connector"} <= dirs
    assert all((REPO / d).is_dir() for d in dirs)


def test_no_unsafe_deserialisation_in_the_package():
    findings = [f for f in scan(package_dirs()) if not _allowed(f)]
    assert not findings, "unsafe deserialisation (or code execution) in the package:\n" + \
        "\n".join(map(str, findings))


def test_allow_list_entries_still_exist():
    findings = scan(package_dirs())
    for path, text, reason in ALLOWED:
        assert reason.strip(), f"{path}: an allow-list entry needs a reason"
        assert any(f.path == path and f.text == text for f in findings), (
            f"stale allow-list entry {path}: {text!r} (the code it excused is gone: drop it)"
        )


PLANTED = '''\
import pickle
import numpy as np
import torch
import yaml
from marshal import loads as mloads
import cloudpickle as cp

def load(blob, path, text, code):
    a = pickle.loads(blob)
    b = torch.load(path)
    c = torch.load(path, weights_only=False)
    d = np.load(path, allow_pickle=True)
    e = yaml.load(text)
    f = yaml.load(text, Loader=yaml.Loader)
    g = yaml.unsafe_load(text)
    h = mloads(blob)
    i = eval(code)
    exec(code)
    j = __import__("dill")
    return a, b, c, d, e, f, g, h, i, j
'''

SAFE = '''\
import json
import numpy as np
import torch
import yaml

class Model:
    def eval(self):
        return self

def load(path, text):
    a = torch.load(path, weights_only=True)
    b = np.load(path)
    c = np.load(path, allow_pickle=False)
    d = yaml.safe_load(text)
    e = yaml.load(text, Loader=yaml.SafeLoader)
    f = yaml.load(text, yaml.CSafeLoader)
    g = eval("1 + 1")
    h = json.loads(text)
    return a, b, c, d, e, f, g, h, Model().eval()
'''


def test_walker_catches_a_planted_pickle_loads(tmp_path):
    (tmp_path / "pkg").mkdir()
    planted = tmp_path / "pkg" / "planted.py"
    planted.write_text("import pickle\n\n\ndef decode(blob):\n    return pickle.loads(blob)\n")
    found = scan([tmp_path / "pkg"], tmp_path)
    assert [str(f) for f in found] == [
        "pkg/planted.py:1: imports pickle: import pickle",
        "pkg/planted.py:5: calls pickle.loads: return pickle.loads(blob)",
    ]


def test_walker_catches_every_unsafe_form_and_reports_file_line(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(PLANTED)
    found = scan_file(path, tmp_path)
    lines = {f.line for f in found}
    # every import and call line of PLANTED but the harmless imports and the def/return lines
    assert lines == {1, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, "\n".join(map(str, found))
    assert all(str(f).startswith(f"bad.py:{f.line}: ") for f in found)


def test_walker_leaves_safe_forms_alone(tmp_path):
    path = tmp_path / "good.py"
    path.write_text(SAFE)
    assert scan_file(path, tmp_path) == []
