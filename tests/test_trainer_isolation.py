import subprocess
import sys

# every trainer module (not only the package and the spec): any of them pulling Django in fails
CODE = """
import importlib, pkgutil, sys
import trainer
for m in pkgutil.walk_packages(trainer.__path__, "trainer."):
    if not m.name.endswith(".__main__"):
        importlib.import_module(m.name)
bad = sorted(n for n in sys.modules if n.split(".")[0] in ("django", "apps", "diloco_platform", "celery"))
assert not bad, f"trainer imported {bad[:5]}"
"""


def test_trainer_never_imports_django():
    subprocess.run([sys.executable, "-c", CODE], check=True)
