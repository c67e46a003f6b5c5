"""The engine installs alone: every `trainer` module imports with only the packages that
pyproject.toml's base `dependencies` (and what they require in turn) would install.

The check runs in a fresh interpreter that refuses to import any top-level module that is
neither the standard library's, the project's `trainer`, nor one of those distributions' own:
what a virtual environment holding only `pip install .` would see. Django, Celery, Redis,
PyYAML, fsspec ... are then missing, as they would be.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import importlib, importlib.abc, importlib.metadata as md, pkgutil, re, sys

    def closure(requirements):
        seen, todo = set(), list(requirements)
        while todo:
            req = todo.pop()
            if ";" in req and "extra ==" in req.split(";", 1)[1]:
                continue  # an optional extra of the dependency: not installed by default
            name = re.split(r"[\\s\\[<>=!~;(]", req.strip(), maxsplit=1)[0]
            key = re.sub(r"[-_.]+", "-", name).lower()
            if key in seen:
                continue
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue  # an environment marker excluded it (other OS / Python)
            seen.add(key)
            todo.extend(dist.requires or [])
        return seen

    allowed_dists = closure(REQUIREMENTS)
    allowed = set(sys.stdlib_module_names) | {"trainer", "_distutils_hack"}
    for top, dists in md.packages_distributions().items():
        if any(re.sub(r"[-_.]+", "-", d).lower() in allowed_dists for d in dists):
            allowed.add(top)

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top not in allowed and not top.startswith("_"):
                raise ModuleNotFoundError(f"No module named {name!r} (not an engine dependency)",
                                          name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    import trainer
    names = sorted(m.name for m in pkgutil.walk_packages(trainer.__path__, "trainer.")
                   if not m.name.endswith(".__main__"))  # those run a command
    for name in names:
        importlib.import_module(name)
    assert "django" not in sys.modules
    print(len(names), "modules")
    """
)


def engine_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def test_every_trainer_module_imports_with_the_engine_dependencies_alone():
    code = f"REQUIREMENTS = {engine_requirements()!r}\n{CHECK}"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[0]) > 40


def test_the_platform_is_not_an_engine_dependency():
    deps = " ".join(engine_requirements()).lower()
    for name in ("django", "celery", "channels", "redis", "pyyaml", "typer"):
        assert name not in deps, name
