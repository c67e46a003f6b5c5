"""The Decoupled DiLoCo training engine: pure Python + PyTorch, never imports Django.

The simulator, the benchmarks and the Celery runtime all run these objects.
"""
