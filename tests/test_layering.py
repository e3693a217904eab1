"""The package's shape, read from the source (every import, at the top of a module or inside a function):
the layers import only downwards, no module imports another module's private names, and no import circle exists.

Layers (README and docs/layout.md): ``kiln.runtimes`` is what an edge app installs without torch, so it imports neither the
compiler nor a pass; passes transform graphs and never import the compiler or a runtime; the server is built on
the runtime alone; the compiler never imports the layers that use it (evaluate, serve, the CLI)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import ROOT

# package -> the kiln packages/modules its modules may import (besides themselves)
ALLOWED = {
    "kiln.errors": set(),
    "kiln.runtimes": {"kiln.errors"},
    "kiln.passes": {"kiln.errors"},
    "kiln.serve": {"kiln.errors", "kiln.runtimes"},
    "kiln.compiler": {"kiln.errors", "kiln.runtimes", "kiln.passes"},
    "kiln.evaluate": {"kiln.errors", "kiln.runtimes", "kiln.passes", "kiln.compiler"},
}
RUNTIME_ONLY = {"kiln.evaluate.bench", "kiln.evaluate.gate", "kiln.evaluate.options", "kiln.evaluate.fmt",
                "kiln.evaluate.tasks", "kiln.evaluate.lm_eval"}
"""``kiln bench`` and ``kiln gate`` run where only the runtime is installed (a release pipeline's gate job), and so
do the task metrics' artifact side and the lm-evaluation-harness model type."""


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


class Import(NamedTuple):
    module: str
    names: list[str]
    """Names taken from ``module`` (empty when the module itself is imported)."""
    alias: str | None
    """The local name a module import binds (``import kiln.x as y``, ``from kiln import x``)."""
    line: int
    at_load: bool
    """Runs when the module is imported (not inside a function)."""


def load_time_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes that run at import time: everything outside function bodies."""
    out, todo = set(), [tree]
    while todo:
        node = todo.pop()
        out.add(id(node))
        todo += [c for c in ast.iter_child_nodes(node)
                 if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every kiln import in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    at_load = load_time_nodes(tree)
    out = []
    for node in ast.walk(tree):
        now = id(node) in at_load
        if isinstance(node, ast.Import):
            out += [Import(a.name, [], a.asname, node.lineno, now) for a in node.names if a.name.split(".")[0] == "kiln"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != "kiln":
                continue
            for a in node.names:  # `from kiln.compiler import trace` imports the module kiln.compiler.trace
                sub = f"{base}.{a.name}"
                out.append(Import(sub, [], a.asname or a.name, node.lineno, now) if sub in known else
                           Import(base, [a.name], None, node.lineno, now))
    return out


class Package(NamedTuple):
    known: dict[str, Path]
    edges: dict[str, dict[str, int]]
    """module -> {imported module: first line}, every import."""
    at_load: dict[str, dict[str, int]]
    """The same, only the imports that run when the module is imported."""
    private: list[str]
    """Private names taken across modules, one line each."""


def graph(root: Path) -> Package:
    known = modules(root)
    edges: dict[str, dict[str, int]] = {}
    at_load: dict[str, dict[str, int]] = {}
    private = []
    for name, path in known.items():
        aliases = {}
        for imp in imports(name, path, known):
            if imp.module != name:
                edges.setdefault(name, {}).setdefault(imp.module, imp.line)
                if imp.at_load:
                    at_load.setdefault(name, {}).setdefault(imp.module, imp.line)
            private += [f"{path.relative_to(root.parent)}:{imp.line} imports {imp.module}.{n}" for n in imp.names
                        if n.startswith("_") and not n.startswith("__") and imp.module != name]
            if imp.alias:
                aliases[imp.alias] = imp.module
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # module._private on an imported kiln module
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and aliases.get(node.value.id, name) != name:
                private.append(f"{path.relative_to(root.parent)}:{node.lineno} uses {node.value.id}.{node.attr}")
    return Package(known, edges, at_load, private)


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer_violations(pkg: Package, where: Path = ROOT) -> list[str]:
    def layer(mod: str) -> str | None:
        return next((p for p in sorted(ALLOWED, key=len, reverse=True) if mod == p or mod.startswith(p + ".")), None)

    bad = []
    for src, targets in pkg.edges.items():
        own = layer(src)
        if own is None:
            continue
        for dst, line in targets.items():
            other = layer(dst) or dst
            if other != own and other not in ALLOWED[own] and dst != "kiln":
                bad.append(f"{pkg.known[src].relative_to(where)}:{line}: {src} imports {dst}")
            elif src in RUNTIME_ONLY and other == "kiln.compiler" and dst in pkg.at_load.get(src, {}):
                bad.append(f"{pkg.known[src].relative_to(where)}:{line}: {src} (runtime-only) imports {dst} at load")
    return bad


@pytest.fixture(scope="module")
def package():
    return graph(ROOT / "kiln")


def test_layers_import_only_downwards(package):
    assert not layer_violations(package)


def test_no_import_circle(package):
    assert not circles(package.edges)


def test_no_private_name_crosses_a_module(package):
    assert not package.private


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "kiln" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "kiln"


def test_planted_circle_layer_break_and_private_import_are_caught(tmp_path):
    """The checks above bite: a runtime importing the compiler, the gate importing it at load time, a circle through
    a function-level import, and a private name taken from another module are each reported."""
    pkg = write(tmp_path, {
        "__init__.py": "", "errors.py": "", "runtimes/__init__.py": "", "compiler/__init__.py": "",
        "runtimes/model.py": "def f():\n    from kiln.compiler import build\n",
        "compiler/build.py": "from kiln.compiler import load\n",
        "compiler/load.py": "def g():\n    from kiln.compiler.build import _check\n    import kiln.compiler.build as b\n"
                            "    return b._helper\n",
        "evaluate/__init__.py": "", "evaluate/gate.py": "from kiln.compiler import load\n",
        "evaluate/bench.py": "def f():\n    from kiln.compiler import load\n",  # lazily: allowed
    })
    found = graph(pkg)
    assert circles(found.edges) == [["kiln.compiler.build", "kiln.compiler.load"]]
    assert [v.split(": ", 1)[1] for v in layer_violations(found, tmp_path)] == \
        ["kiln.evaluate.gate (runtime-only) imports kiln.compiler.load at load",
         "kiln.runtimes.model imports kiln.compiler.build"]
    assert len(found.private) == 2 and "imports kiln.compiler.build._check" in found.private[0]
    assert "uses b._helper" in found.private[1]
