"""`python -m trainer train ...` (see trainer/cli.py)."""
import sys

from trainer.cli import main

code = main()
island = sys.modules.get("trainer.island")  # imported only by runs with islands (keeps --help fast)
if island is not None:
    island.exit_process(code)
sys.exit(code)
