"""The project's layout, read from the sources (``ast``; nothing imported): only ``beatflow.pipeline``
imports Prefect and Dask, and the project's modules import each other without circles. Both count every
import: at module level, inside functions and classes, under ``if TYPE_CHECKING``, and
``importlib.import_module`` / ``__import__`` of a constant name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the project's own top-level packages (flows/, tasks/, deployments/: the checkout's Prefect entry points)
PACKAGES = ("beatflow", "flows", "tasks", "deployments")
#: what only beatflow/pipeline/ may import
ORCHESTRATION = ("prefect", "prefect_dask", "distributed", "dask", "dask_cuda")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under the packages (a package by its ``__init__``)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(name: str, path: Path) -> list[tuple[str, int]]:
    """Every name the module ``name`` (its file ``path``) imports, with its line: ``import a.b`` gives
    ``a.b``; ``from a import b, c`` gives ``a.b`` and ``a.c`` (a module or a name of ``a``: see
    :func:`resolve`); relative imports are made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out += [(f"{base}.{a.name}" if a.name != "*" else base, node.lineno) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if called in ("import_module", "__import__"):
                out.append((node.args[0].value, node.lineno))
    return out


def resolve(imported: str, modules) -> str | None:
    """The project module an imported name loads: the longest prefix of it that is one (``a.b.f``, a
    function of the module ``a.b``, is ``a.b``); None for an outside module."""
    while imported and imported not in modules:
        imported = imported.rpartition(".")[0]
    return imported or None


def import_graph(root: Path, packages=PACKAGES) -> tuple[dict[str, set], dict]:
    """The project's import graph ``{module: modules it imports}`` and, per edge, where: ``{(a, b): "file:line"}``.
    A module's import of itself (``from . import x`` in a package's ``__init__`` naming a name of its own) is
    no edge."""
    modules = module_files(root, packages)
    graph, where = {m: set() for m in modules}, {}
    for name, path in modules.items():
        for imported, line in imported_names(name, path):
            target = resolve(imported, modules)
            if target is not None and target != name:
                graph[name].add(target)
                where.setdefault((name, target), f"{path.relative_to(root)}:{line}")
    return graph, where


def circles(graph: dict[str, set]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of more than one module (Tarjan's
    algorithm, iterative), each sorted, in sorted order."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def _circle_text(circle: list[str], graph: dict[str, set], where: dict) -> str:
    inside = set(circle)
    edges = sorted((a, b) for a in circle for b in graph[a] if b in inside)
    return "circle: " + " ".join(circle) + "".join(f"\n    {a} -> {b} ({where[a, b]})" for a, b in edges)


def test_only_the_pipeline_imports_prefect_and_dask():
    """No module of ``beatflow`` outside ``beatflow/pipeline/`` imports Prefect, prefect-dask or Dask (at
    module level or inside a function): the numeric modules run without them, and the command
    (``beatflow.cli``) reaches them only through ``beatflow.pipeline``."""
    pipeline = ROOT / "beatflow" / "pipeline"
    found = []
    for name, path in module_files(ROOT, ("beatflow",)).items():
        if pipeline in path.parents:
            continue
        for imported, line in imported_names(name, path):
            if imported.split(".")[0] in ORCHESTRATION:
                found.append(f"{path.relative_to(ROOT)}:{line}: {imported}")
    assert not found, "imports of Prefect/Dask outside beatflow/pipeline/:\n" + "\n".join(found)


def test_the_projects_modules_import_each_other_without_circles():
    """The modules of beatflow, flows, tasks and deployments form no circle of imports, imports inside
    functions included (each circle is listed with the imports that close it)."""
    graph, where = import_graph(ROOT)
    assert {"beatflow.cli", "beatflow.pipeline.flow", "flows.pipeline", "deployments.entrypoints"} <= set(graph)
    found = circles(graph)
    assert not found, "\n".join(_circle_text(c, graph, where) for c in found)


def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize("late_import, want", [
    ("def f():\n    from ..a import g\n", [["pkg.a", "pkg.sub.b"]]),  # inside a function, relative
    ("def f():\n    import importlib\n    importlib.import_module('pkg.a')\n", [["pkg.a", "pkg.sub.b"]]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n", [["pkg.a", "pkg.sub.b"]]),
    ("import os\nfrom os.path import join\n", []),  # outside modules only
])
def test_the_circle_check_sees_imports_anywhere_in_a_module(tmp_path, late_import, want):
    """The check itself, on a small package: ``pkg.a`` imports ``pkg.sub.b`` (a name of it), and
    ``pkg.sub.b`` imports ``pkg.a`` back in the ways a module can."""
    root = _package(tmp_path, {"pkg/__init__.py": "from pkg import a  # (a package's own module: no circle)\n",
                               "pkg/a.py": "from pkg.sub.b import thing\n\ndef g():\n    pass\n",
                               "pkg/sub/__init__.py": "", "pkg/sub/b.py": "thing = 1\n" + late_import,
                               "pkg/c.py": "import pkg.sub.b\n"})
    graph, where = import_graph(root, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg"] == {"pkg.a"}
    assert circles(graph) == want
    if want:
        assert where["pkg.sub.b", "pkg.a"].startswith("pkg/sub/b.py:")
