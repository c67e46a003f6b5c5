"""Limit/offset pagination with bounds (a huge offset or limit is clamped, never a database error)."""
from __future__ import annotations

from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 10**9


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    max_limit = 500

    def get_offset(self, request):
        return min(super().get_offset(request), MAX_OFFSET)
