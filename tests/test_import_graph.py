"""No import loops in apps/, trainer/ and diloco_platform/, counting imports inside functions.

A loop held together by a function-level import works until someone moves the import up or
imports the modules in another order; so every `import` statement counts, wherever it is.
The graph is read with `ast` (nothing is imported) and checked with the standard library's
`graphlib`, which names one cycle when there is one.
"""
from __future__ import annotations

import ast
import graphlib
import sys
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



# ---------------------------------------------------------------------------- layer order
# The units of the code, lowest layer first: a module imports its own unit and the units of the
# layers below it, never a unit above or beside it. `trainer` (the engine) stands alone;
# `diloco_platform` here is settings, the Celery app and the process table, and its two wiring
# modules (URLs, ASGI routing) sit above every app; `diloco_cli` is an HTTP client of its own.
LAYERS: list[tuple[str, ...]] = [
    ("trainer",),
    ("diloco_platform",),
    ("apps.inventory",),                # the fleet: accelerators, pools, nodes, tokens
    ("apps.jobs",),                     # jobs and learners placed on the fleet
    ("apps.telemetry",),                # agents' and dashboards' websockets, live publishing
    ("apps.coordinator",),              # placement, learners, syncers, watchdog, rebalancer
    ("apps.api", "apps.dashboard"),     # two faces over the same rows: neither imports the other
    ("wiring",),                        # diloco_platform.urls / asgi: route to every app
]
WIRING = {"diloco_platform.urls", "diloco_platform.asgi"}
ALL_PACKAGES = (*PACKAGES, "diloco_cli")

# Today's imports that go up or sideways, one `module -> module` each. Known debts, not a licence:
# a new one fails; one that is fixed may leave this list.
KNOWN_BACKWARD: dict[str, str] = {
    # issue 36 (6): the dashboard borrows the API's token authentication, throttles, models,
    # blob streaming helper and placement preview instead of a shared layer below both
    "apps.dashboard.views -> apps.api.authentication": "issue 36 (6)",
    "apps.dashboard.views -> apps.api.models": "issue 36 (6)",
    "apps.dashboard.views -> apps.api.throttling": "issue 36 (6)",
    "apps.dashboard.views -> apps.api.views.checkpoints": "issue 36 (6): the private blob_response",
    "apps.dashboard.preview -> apps.api.placement": "issue 36 (6)",
    # issue 36 (6): shared queries live in the UI app; the API and /metrics read them there
    "apps.api.views.compare -> apps.dashboard.compare": "issue 36 (6)",
    "apps.telemetry.prometheus -> apps.dashboard.data": "issue 36 (6): /metrics",
    # issue 36 (8): demo harness inside the inventory app (submits jobs, chaos button)
    "apps.inventory.management.commands.demo -> apps.dashboard.demo_chaos": "issue 36 (8)",
    "apps.inventory.management.commands.demo -> apps.jobs.models": "issue 36 (8)",
    "apps.inventory.management.commands.demo -> apps.jobs.services": "issue 36 (8)",
    "apps.inventory.management.commands.demo -> apps.jobs.spec": "issue 36 (8)",
    # fleet housekeeping that reads the jobs' rows: node samples count running learners,
    # a silent node's purge writes a job event
    "apps.inventory.history -> apps.jobs.models": "fleet samples from learners",
    "apps.inventory.liveness -> apps.jobs.models": "node purge events",
    # revoking a pool token closes its agents' websockets (function-level import)
    "apps.inventory.models -> apps.telemetry.publish": "token revocation",
}

# What the engine may import at module level: the standard library and the dependencies
# `pip install .` brings (pyproject's [project] dependencies); optional backends (redis, s3fs,
# tokenizers, torch_xla, ...) only inside the function that needs them.
PLATFORM_ONLY = {"django", "rest_framework", "drf_spectacular", "channels", "channels_redis", "celery",
                 "kombu", "django_celery_beat", "environ", "whitenoise", "psycopg", "daphne", "gunicorn",
                 "uvicorn", "typer", "httpx", "apps", "diloco_platform", "diloco_cli"}
# The CLI talks HTTP to the platform: the standard library and these, nothing of the server.
CLI_THIRD_PARTY = {"httpx", "typer", "rich", "yaml"}


def unit_of(module: str) -> str:
    if module in WIRING:
        return "wiring"
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "apps" else parts[0]


def backward_edges(graph: dict[str, set[str]]) -> set[str]:
    """`module -> module` for every import that goes up the layers or sideways between units."""
    rank = {u: i for i, units in enumerate(LAYERS) for u in units}
    out = set()
    for module, deps in graph.items():
        for dep in deps:
            a, b = unit_of(module), unit_of(dep)
            if a != b and (a not in rank or b not in rank or rank[a] <= rank[b]):
                out.add(f"{module} -> {dep}")
    return out


def external_imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level name, at run time on import of the module?) for each absolute import of a file;
    imports inside functions and under `if TYPE_CHECKING:` are not run on import."""
    out: list[tuple[str, bool]] = []

    def walk(node, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((alias.name.split(".")[0], eager) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level:
                out.append(((child.module or "").split(".")[0], eager))
            else:
                lazy = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) or (
                    isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
                walk(child, eager and not lazy)

    walk(ast.parse(path.read_text(), str(path)), True)
    return out


def engine_dependencies() -> set[str]:
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[^A-Za-z0-9_.-]", d, maxsplit=1)[0].replace("-", "_").lower() for d in deps}


def test_apps_keep_their_layer_order():
    graph = import_graph(ROOT, ALL_PACKAGES)
    assert {unit_of(m) for m in graph} >= {u for units in LAYERS for u in units} | {"diloco_cli"}
    new = sorted(backward_edges(graph) - set(KNOWN_BACKWARD))
    assert not new, ("imports against the layer order (move the code down a layer, or add a "
                     "commented KNOWN_BACKWARD entry with its reason):\n  " + "\n  ".join(new))


def test_the_engine_and_the_cli_stand_alone():
    files = module_files(ROOT, ("trainer", "diloco_cli"))
    stdlib = set(sys.stdlib_module_names)
    engine = engine_dependencies()
    assert {"torch", "pydantic"} <= engine, engine
    bad = []
    for module, path in files.items():
        own = module.split(".")[0]
        for name, eager in external_imports(path):
            if name in (own, "__future__") or name in stdlib:
                continue
            if own == "trainer" and (name in PLATFORM_ONLY or (eager and name not in engine)):
                bad.append(f"{module} imports {name}" + (" at module level" if eager else ""))
            if own == "diloco_cli" and name not in CLI_THIRD_PARTY:
                bad.append(f"{module} imports {name}")
    assert not bad, bad


def test_the_layer_check_sees_a_new_backwards_import(tmp_path):
    """A module of a lower layer importing a higher one, or one face importing the other, is
    reported; the same imports downwards are not."""
    tree = {"apps/__init__.py": "", "apps/jobs/__init__.py": "",
            "apps/jobs/models.py": "def f():\n    from apps.coordinator import control\n",
            "apps/coordinator/__init__.py": "",
            "apps/coordinator/control.py": "from apps.jobs.models import f\n",
            "apps/api/__init__.py": "", "apps/api/views.py": "from apps.dashboard import data\n",
            "apps/dashboard/__init__.py": "", "apps/dashboard/data.py": "import apps.jobs.models\n",
            "trainer/__init__.py": "", "trainer/spec.py": "import apps.jobs.models\n"}
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = backward_edges(import_graph(tmp_path, ("apps", "trainer")))
    assert edges == {"apps.jobs.models -> apps.coordinator.control", "apps.api.views -> apps.dashboard.data",
                     "trainer.spec -> apps.jobs.models"}
    assert ("apps", True) in external_imports(tmp_path / "trainer/spec.py")
    assert external_imports(tmp_path / "apps/jobs/models.py") == [("apps", False)]
