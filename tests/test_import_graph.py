"""No import loops in apps/, trainer/ and diloco_platform/, counting imports inside functions.

A loop held together by a function-level import works until someone moves the import up or
imports the modules in another order; so every `import` statement counts, wherever it is.
The graph is read with `ast` (nothing is imported) and checked with the standard library's
`graphlib`, which names one cycle when there is one.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("apps", "trainer", "diloco_platform")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root` (migrations left out)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement of the module may load, anywhere in the file."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.update(f"{source}.{alias.name}" for alias in node.names)  # a submodule or a name in it
    return names


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (the longest known prefix of each name)."""
    files = module_files(root, packages)
    graph = {}
    for module, path in files.items():
        deps = set()
        for name in _imported_names(module, path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules to mean anything"
    cycle = find_cycle(graph)
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


def test_jobs_never_reach_into_the_coordinator():
    """apps.jobs is what the coordinator works on: its tasks import services, never the reverse."""
    graph = import_graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("apps.jobs")
                for d in deps if d.startswith("apps.coordinator"))
    assert not up, up


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n    return thing\n")
    (pkg / "c.py").write_text("import os\n\n\ndef g():\n    import pkg.a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.sub.b", "pkg.c"}
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None

