"""Who may do what: people read the fleet, staff change it; workers act for their pool."""
from __future__ import annotations

from rest_framework import permissions

from .authentication import PoolPrincipal


class IsPerson(permissions.BasePermission):
    """A signed-in user (never a worker)."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        return bool(user and user.is_authenticated and not isinstance(user, PoolPrincipal))


class IsStaffOrReadOnly(IsPerson):
    """Signed-in users read; staff write."""

    message = "Only staff may change the fleet."

    def has_permission(self, request, view) -> bool:
        if not super().has_permission(request, view):
            return False
        return request.method in permissions.SAFE_METHODS or request.user.is_staff


class IsPoolAgent(permissions.BasePermission):
    """A worker authenticated with a pool token."""

    message = "A pool token is required."

    def has_permission(self, request, view) -> bool:
        return isinstance(request.user, PoolPrincipal)
