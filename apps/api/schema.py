"""OpenAPI descriptions of the API's own authentication classes (drf-spectacular extensions)."""
from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "apps.api.authentication.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": "Personal API token (`dl_...`) from POST /api/v1/auth/token/"}


class PoolTokenScheme(OpenApiAuthenticationExtension):
    target_class = "apps.api.authentication.PoolTokenAuthentication"
    name = "poolToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "Worker token of one pool (`pt_...`)"}


ERROR_SCHEMA = {
    "type": "object",
    "description": "Every error has this shape: a summary and messages by field path.",
    "properties": {
        "detail": {"type": "string"},
        "errors": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
    },
    "required": ["detail", "errors"],
}
ERROR_STATUSES = {
    "400": "Invalid input: messages by field path (`spec.learners`)",
    "401": "Missing or invalid credentials",
    "403": "Not allowed",
    "404": "Not found (or not yours)",
    "405": "Method not allowed",
    "406": "Not acceptable",
    "409": "Conflicts with the current state (job status, idempotency key, resources in use)",
    "413": "Request body too large",
    "415": "Unsupported media type (send JSON)",
    "429": "Rate limited; see Retry-After",
    "503": "A backing service (blob store) is unavailable",
}


def add_error_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook: document the error shape on every operation."""
    components = result.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    ref = {"$ref": "#/components/schemas/Error"}
    for methods in result.get("paths", {}).values():
        for op in methods.values():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            for code, text in ERROR_STATUSES.items():
                op["responses"][code] = {"description": text,
                                         "content": {"application/json": {"schema": ref}}}
    return result
