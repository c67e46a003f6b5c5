import subprocess
import sys


def test_trainer_never_imports_django():
    code = "import trainer, trainer.spec, sys; assert 'django' not in sys.modules, 'trainer imported django'"
    subprocess.run([sys.executable, "-c", code], check=True)
