"""Platform-side spec validation: the shared schema plus checks that need settings."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from pydantic import ValidationError

from trainer.spec import JobSpec, spec_errors


class SpecError(ValueError):
    """A spec that does not validate; `errors` maps field paths to messages."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("; ".join(f"{k}: {', '.join(v)}" for k, v in errors.items()))
        self.errors = errors


def dataset_allowed(dataset: str) -> bool:
    """'stdlib', or a path that resolves inside one of settings.DATA_ROOTS."""
    if dataset == "stdlib":
        return True
    try:
        path = Path(dataset).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(path == root or root in path.parents for root in settings.DATA_ROOTS)


def validate_spec(data: Any) -> JobSpec:
    """Validate a job spec (dict) or raise SpecError with field-level messages."""
    if not isinstance(data, dict):
        raise SpecError({"non_field_errors": ["the spec must be a JSON object"]})
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(spec_errors(exc)) from None
    if not dataset_allowed(spec.dataset):
        roots = ", ".join(str(r) for r in settings.DATA_ROOTS)
        raise SpecError({"dataset": [f"must be 'stdlib' or a path under a data root ({roots})"]})
    return spec
