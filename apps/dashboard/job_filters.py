"""The jobs list's filters, all in the URL query string: a filtered view survives a reload
and can be shared as a link.

`status` (a job status or "active"), `owner` (a username), `team`, `pool` (a pool slug: jobs
with a learner placed there) and `q` (free text over name, team and owner, or #id). A value
that names nothing simply matches nothing; an unknown status is ignored, as before, and so is
a value with a NUL character (PostgreSQL cannot compare text with one).
"""
from __future__ import annotations

import dataclasses
from urllib.parse import urlencode

from django.db.models import Q, QuerySet
from django.http import QueryDict

from apps.jobs import state as st
from apps.jobs.models import Learner

from .data import ACTIVE

MAX_LEN = 100


@dataclasses.dataclass(frozen=True)
class JobFilters:
    status: str = ""
    owner: str = ""
    team: str = ""
    pool: str = ""
    q: str = ""

    @classmethod
    def from_query(cls, params: QueryDict) -> JobFilters:
        def get(name: str) -> str:
            value = params.get(name, "")
            if "\x00" in value:  # PostgreSQL refuses NUL in text (a 500): a value with one is ignored
                return ""
            return value.strip()[:MAX_LEN]

        status = get("status")
        if status != "active" and status not in st.STATUSES:
            status = ""
        return cls(status=status, owner=get("owner"), team=get("team"), pool=get("pool"), q=get("q"))

    def apply(self, jobs: QuerySet) -> QuerySet:
        if self.status == "active":
            jobs = jobs.filter(status__in=ACTIVE)
        elif self.status:
            jobs = jobs.filter(status=self.status)
        if self.owner:
            jobs = jobs.filter(owner__username=self.owner)
        if self.team:
            jobs = jobs.filter(team=self.team)
        if self.pool:
            jobs = jobs.filter(pk__in=Learner.objects.filter(pool__slug=self.pool).values("job_id"))
        if self.q:
            q = self.q
            cond = Q(name__icontains=q) | Q(team__icontains=q) | Q(owner__username__icontains=q)
            digits = self.q.lstrip("#")
            if digits.isascii() and digits.isdigit() and len(digits) <= 18:  # "²" is isdigit(), not int()
                cond |= Q(pk=int(digits))
            jobs = jobs.filter(cond)
        return jobs

    def query(self, **changes: str | int) -> str:
        """The query string of these filters with `changes` (empty values left out), "?..." or "?"."""
        values = {**dataclasses.asdict(self), **changes}
        return "?" + urlencode({k: v for k, v in values.items() if v not in ("", None)})

    @property
    def any(self) -> bool:
        return any(dataclasses.astuple(self))
