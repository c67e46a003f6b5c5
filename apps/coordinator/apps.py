import logging
import os

from django.apps import AppConfig

log = logging.getLogger("apps.coordinator")


class CoordinatorConfig(AppConfig):
    name = "apps.coordinator"
    label = "coordinator"

    def ready(self) -> None:
        from celery.signals import worker_init

        worker_init.connect(_warm_worker, weak=False)


def _warm_worker(**kwargs) -> None:
    """Warm the worker's main process before it forks its pool: learners then start in well
    under a second instead of ~10 s (torch's optimizer machinery imports torch._dynamo on first
    use; the default corpus fingerprints thousands of files). Set DILOCO_WARM=0 to skip."""
    if os.environ.get("DILOCO_WARM", "1") == "0":
        return
    import torch

    torch.set_num_threads(1)
    try:
        if os.environ.get("DILOCO_POOL"):  # learners build an AdamW; syncers do not
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))], lr=1e-3, fused=True)
        import trainer.learner  # noqa: F401
        import trainer.runtime.learner_loop  # noqa: F401
        import trainer.syncer  # noqa: F401

        from .common import corpus, default_cache_dir

        corpus("stdlib", default_cache_dir())
    except Exception:
        log.warning("worker warm-up failed", exc_info=True)
