"""`diloco jobs compare` against a live server: the rich table, --json, --baseline, bad ids."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs.models import Job, MetricPoint

pytestmark = pytest.mark.django_db(transaction=True)


def _job(owner, name: str, start: float, last_tokens: int) -> Job:
    t0 = timezone.now() - timedelta(minutes=10)
    job = Job.objects.create(owner=owner, name=name, spec={"strategy": "decoupled", "learners": 1},
                             status="completed", started_at=t0, finished_at=t0 + timedelta(seconds=90),
                             tokens_computed=last_tokens)
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, name="train_loss", step=x, value=start - x / 10_000,
                    time=t0 + timedelta(seconds=x / 1000)) for x in range(0, last_tokens + 1, 1000))
    return job


def test_compare_table_and_json(cli, alice, bob):
    base, other = _job(alice, "base", 3.0, 10_000), _job(alice, "other", 3.3, 5_000)
    hidden = _job(bob, "bobs", 1.0, 10_000)
    r = cli("jobs", "compare", base.pk, other.pk, hidden.pk)
    assert r.exit_code == 0, r.stderr
    assert f"train_loss against baseline #{base.pk} base" in r.stdout
    row = next(line for line in r.stdout.splitlines() if f"#{other.pk} " in line)
    assert "+12.00%" in row and "2.8000" in row and "90 s" in row and "5.0k" in row
    assert "baseline" in next(line for line in r.stdout.splitlines() if f"#{base.pk} " in line)
    assert f"not shown: job(s) {hidden.pk}" in r.stderr and "bobs" not in r.stdout

    code, body = cli.json("jobs", "compare", base.pk, other.pk, "--baseline", other.pk)
    assert code == 0 and body["baseline"] == other.pk
    gaps = {j["id"]: j["gap_pct"] for j in body["jobs"]}
    assert gaps[other.pk] == 0.0 and gaps[base.pk] == pytest.approx(100 * (2.5 - 2.8) / 2.8)


def test_compare_bad_input_exits_2_with_the_field(cli, alice):
    job = _job(alice, "only", 3.0, 2_000)
    code, body = cli.json("jobs", "compare", job.pk, "--baseline", job.pk + 1)
    assert code == 2 and body["exit_code"] == 2 and "baseline" in body["errors"]
    r = cli("jobs", "compare", job.pk, "--metric", "accuracy")
    assert r.exit_code == 2 and "metric:" in r.stderr
    r = cli("jobs", "compare", 987654)
    assert r.exit_code == 2 and "jobs:" in r.stderr
