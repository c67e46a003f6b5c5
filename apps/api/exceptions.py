"""One error shape for the whole API.

    {"detail": "<summary>", "errors": {"<field.path>": ["message", ...]}}

Validation errors are flattened to dotted field paths (`spec.learners`, `pools.2`);
errors that belong to no field use `non_field_errors` (or `detail` for auth, permission,
not-found, throttling and parse errors).
"""
from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from apps.jobs.spec import SpecError
from apps.jobs.state import IllegalTransition

log = logging.getLogger(__name__)


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state of the resource."
    default_code = "conflict"


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Request body too large."
    default_code = "too_large"


class ServiceUnavailable(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "Service temporarily unavailable."
    default_code = "unavailable"


def flatten_errors(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF error detail (nested dicts/lists) -> {dotted.path: [messages]}."""
    out: dict[str, list[str]] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, val in node.items():
                key = str(key)
                if key == "non_field_errors" and path:
                    walk(val, path)
                else:
                    walk(val, f"{path}.{key}" if path else key)
        elif isinstance(node, list):
            if all(not isinstance(x, dict | list) for x in node):
                out.setdefault(path or "non_field_errors", []).extend(str(x) for x in node)
            else:
                for i, val in enumerate(node):
                    if val in ({}, []):
                        continue
                    walk(val, f"{path}.{i}" if path else str(i))
        else:
            out.setdefault(path or "non_field_errors", []).append(str(node))

    walk(detail, prefix)
    return out


MAX_ERROR_FIELDS = 50  # a 400 names at most this many fields, then counts the rest


def _capped(errors: dict[str, list[str]]) -> dict[str, list[str]]:
    """At most MAX_ERROR_FIELDS entries: a body of thousands of bad keys must not be echoed whole."""
    if len(errors) <= MAX_ERROR_FIELDS:
        return errors
    out = dict(list(errors.items())[:MAX_ERROR_FIELDS])
    more = f"... and {len(errors) - MAX_ERROR_FIELDS} more errors."
    out["non_field_errors"] = [*out.get("non_field_errors", []), more]
    return out


def _summary(errors: dict[str, list[str]]) -> str:
    parts = [f"{k}: {'; '.join(v)}" for k, v in list(errors.items())[:5]]
    more = len(errors) - 5
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def error_response(status_code: int, errors: dict[str, list[str]], detail: str | None = None,
                   headers: dict | None = None) -> Response:
    return Response({"detail": detail or _summary(errors), "errors": errors}, status=status_code,
                    headers=headers)


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, SpecError):
        prefix = getattr(exc, "path_prefix", "")
        errors = _capped({(f"{prefix}.{k}" if prefix and k != "non_field_errors" else (prefix or k)): v
                          for k, v in exc.errors.items()})
        return error_response(400, errors, "Invalid job spec: " + _summary(errors))
    if isinstance(exc, IllegalTransition):
        return error_response(409, {"status": [str(exc)]}, str(exc))
    if isinstance(exc, RequestDataTooBig):
        exc = PayloadTooLarge()
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()

    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a real bug: let Django log it and answer 500
    if isinstance(exc, exceptions.ValidationError):
        errors = _capped(flatten_errors(exc.detail))
        response.data = {"detail": _summary(errors), "errors": errors}
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        if isinstance(detail, dict | list):
            errors = _capped(flatten_errors(detail))
            response.data = {"detail": _summary(errors), "errors": errors}
        else:
            response.data = {"detail": str(detail), "errors": {"detail": [str(detail)]}}
    return response
