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
