"""`diloco`: the command-line client of the DiLoCo platform (for people and CI pipelines)."""

__version__ = "0.1.0"
