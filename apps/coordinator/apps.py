from django.apps import AppConfig


class CoordinatorConfig(AppConfig):
    name = "apps.coordinator"
    label = "coordinator"

    def ready(self) -> None:
        from celery.signals import worker_init

        worker_init.connect(_warm_worker, weak=False)


def _warm_worker(**kwargs) -> None:
    """Import the engine in the worker's main process so pool children start learners warm."""
    import torch

    torch.set_num_threads(1)
    try:
        import trainer.data  # noqa: F401
        import trainer.models  # noqa: F401
        import trainer.runtime.learner_loop  # noqa: F401
    except Exception:
        pass
