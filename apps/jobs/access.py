"""Who may see and act on a job: its owner, the members of its team, and staff.

A team is a Django auth group (staff create it and add members in the admin); a job's `team`
is the group's name. The API, the dashboard and the websockets all filter through here, so a
teammate sees exactly what the owner sees.
"""
from __future__ import annotations

from django.contrib.auth.models import Group
from django.db.models import Q, QuerySet

from .models import Job


def team_names(user) -> list[str]:
    if not getattr(user, "is_authenticated", False):
        return []
    loaded = getattr(user, "loaded_team_names", None)  # read with the API token (apps.api.models)
    if loaded is not None:
        return list(loaded)
    return list(user.groups.values_list("name", flat=True))


def job_access_q(user, prefix: str = "") -> Q:
    """Q over jobs (or, with prefix "job__", over rows that point at a job) this user may see."""
    if getattr(user, "is_staff", False):
        return Q()
    own = Q(**{f"{prefix}owner": user})
    teams = team_names(user)
    if not teams:
        return own
    return own | (Q(**{f"{prefix}team__in": teams}) & ~Q(**{f"{prefix}team": ""}))


def job_or_fleet_q(user) -> Q:
    """Q over rows with an optional job (events, incidents): those of jobs this user may see,
    plus the fleet's own (no job), which every signed-in user may read. Staff see all."""
    if getattr(user, "is_staff", False):
        return Q()
    return Q(job__isnull=True) | job_access_q(user, "job__")


def visible_jobs(user, queryset: QuerySet[Job] | None = None) -> QuerySet[Job]:
    """Staff see every job; everyone else their own and their teams'."""
    qs = Job.objects.all() if queryset is None else queryset
    return qs.filter(job_access_q(user))


def team_error(user, team: str) -> str | None:
    """Why `user` may not submit a job for `team` (None: they may). Blank means no team."""
    if not team:
        return None
    if not Group.objects.filter(name=team).exists():
        return f"There is no team {team!r}; staff create teams (groups) in the admin."
    if not getattr(user, "is_staff", False) and not user.groups.filter(name=team).exists():
        return f"You are not a member of team {team!r}."
    return None
