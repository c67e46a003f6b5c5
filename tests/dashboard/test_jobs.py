"""The jobs list, the new-job form (schema errors inline, dry run) and the job actions."""
from __future__ import annotations

import pytest

from apps.jobs.models import Event, Job


@pytest.mark.django_db
def test_list_filters_and_search(client, alice, job_factory):
    job_factory(alice, name="alpha-run", status="running")
    job_factory(alice, name="beta-run", status="completed")
    job_factory(alice, name="gamma-run", status="queued", team="vision")
    client.force_login(alice)
    body = client.get("/jobs/?status=completed").content.decode()
    assert "beta-run" in body and "alpha-run" not in body and "gamma-run" not in body
    body = client.get("/jobs/?status=active").content.decode()
    assert "alpha-run" in body and "beta-run" not in body
    body = client.get("/jobs/?q=vision").content.decode()
    assert "gamma-run" in body and "alpha-run" not in body
    gamma = Job.objects.get(name="gamma-run")
    body = client.get(f"/jobs/?q=%23{gamma.pk}").content.decode()
    assert "gamma-run" in body and "beta-run" not in body
    # unknown status is ignored, not an error
    assert client.get("/jobs/?status=nonsense").status_code == 200


@pytest.mark.django_db
def test_form_has_every_schema_field(client, alice, fleet):
    from trainer.spec import JobSpec

    client.force_login(alice)
    body = client.get("/jobs/new").content.decode()
    for name in JobSpec.model_fields:
        assert f'name="{name}"' in body, name
    assert 'value="h100-east"' in body  # pools come from the inventory
    assert 'name="learners" value="4"' in body or 'value="4"' in body


def _input_attrs(body: str, name: str) -> dict[str, str]:
    import re

    tag = re.search(rf'<input[^>]*name="{name}"[^>]*>', body).group(0)
    return dict(re.findall(r'(\w+)="([^"]*)"', tag))


def test_exclusive_bounds_are_not_inclusive_html_bounds():
    """pydantic's lt / gt exclude the bound, HTML's max / min include it: the form emits the
    nearest value inside the bound (an int: bound -/+ 1; a float: the next double)."""
    import math

    from pydantic import BaseModel, Field

    from apps.dashboard.forms import _field_for

    class Spec(BaseModel):
        count: int = Field(5, gt=0, lt=10)
        ratio: float = Field(0.5, gt=0, lt=1.0)
        share: float | None = Field(None, ge=0, le=1.0)

    attrs = {name: _field_for(name, info, []).widget.attrs for name, info in Spec.model_fields.items()}
    assert (attrs["count"]["min"], attrs["count"]["max"]) == (1, 9)
    lo, hi = float(attrs["ratio"]["min"]), float(attrs["ratio"]["max"])
    assert lo > 0 and hi < 1.0 and hi == math.nextafter(1.0, 0) and lo == math.nextafter(0.0, 1)
    assert (attrs["share"]["min"], attrs["share"]["max"]) == (0, 1.0)  # inclusive stays as it is


@pytest.mark.django_db
def test_form_bounds_follow_the_schema(client, alice, fleet):
    """outer_momentum is `ge=0, lt=1.0` and outer_lr `gt=0`: the page never offers the excluded
    bound, and a posted 1.0 is refused on the server under its field."""
    client.force_login(alice)
    body = client.get("/jobs/new").content.decode()
    momentum, lr = _input_attrs(body, "outer_momentum"), _input_attrs(body, "outer_lr")
    assert float(momentum["min"]) == 0 and float(momentum["max"]) < 1.0, momentum
    assert float(lr["min"]) > 0, lr
    resp = client.post("/jobs/new", _form(outer_momentum="1.0", action="submit"))
    assert resp.status_code == 200 and "outer_momentum" in resp.context["form"].errors
    assert Job.objects.count() == 0


def _form(**over):
    from trainer.spec import JobSpec

    data = {}
    for name, info in JobSpec.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if name == "pools":
            continue
        data[name] = "" if default is None else str(default)
    data.update(over)
    return data


@pytest.mark.django_db
def test_bad_values_show_schema_errors_inline(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(learners="0", outer_lr="abc", name="x", action="submit"))
    assert resp.status_code == 200
    form = resp.context["form"]
    assert "greater than or equal to 1" in form.errors["learners"][0]
    assert "outer_lr" in form.errors
    assert Job.objects.count() == 0
    body = resp.content.decode()
    assert 'id="id_learners_error"' in body and 'aria-invalid="true"' in body


@pytest.mark.django_db
def test_cross_field_error_lands_on_its_field(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(learners="2", quorum="3", action="submit"))
    assert resp.status_code == 200
    assert "must not exceed learners" in resp.context["form"].errors["quorum"][0]


@pytest.mark.django_db
def test_dataset_outside_data_roots_is_refused(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(dataset="/etc/passwd", action="submit"))
    assert resp.status_code == 200
    assert "data root" in resp.context["form"].errors["dataset"][0]


@pytest.mark.django_db
def test_required_field_cleared(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(learners="", action="submit"))
    assert resp.status_code == 200
    assert resp.context["form"].errors["learners"] == ["This field is required."]


@pytest.mark.django_db(transaction=True)
def test_submit_creates_job_and_redirects(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(name="from-form", learners="2", pools=["h100-east"],
                                          action="submit"))
    assert resp.status_code == 302, resp.context["form"].errors if resp.context else resp
    job = Job.objects.get(name="from-form")
    assert resp["Location"] == f"/jobs/{job.pk}/"
    assert job.owner == alice and job.spec["learners"] == 2 and job.spec["pools"] == ["h100-east"]
    assert job.status == "queued"


@pytest.mark.django_db
def test_dry_run_previews_placement_without_creating(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(learners="3", action="dry_run"))
    assert resp.status_code == 200
    preview = resp.context["preview"]
    assert preview["ok"], preview["problems"]
    assert len(preview["learners"]) == 3
    assert {lr["pool"] for lr in preview["learners"]} <= {"h100-east", "a100-west", "v100-lab"}
    assert preview["estimate"]["time_s"] > 0 and preview["estimate"]["cost"] >= 0
    assert Job.objects.count() == 0
    assert b"Planned placement" in resp.content


@pytest.mark.django_db
def test_dry_run_reports_when_it_cannot_fit(client, alice, fleet):
    client.force_login(alice)
    resp = client.post("/jobs/new", _form(learners="40", pools=["v100-lab"], action="dry_run"))
    assert resp.status_code == 200
    preview = resp.context["preview"]
    assert not preview["ok"] and preview["problems"]


@pytest.mark.django_db(transaction=True)
def test_cancel_pause_resume(client, alice, job_factory):
    job = job_factory(alice)
    client.force_login(alice)
    assert client.post(f"/jobs/{job.pk}/pause").status_code == 302
    job.refresh_from_db()
    assert job.status == "pausing"
    resp = client.post(f"/jobs/{job.pk}/resume", follow=True)  # pausing -> placing is not allowed
    job.refresh_from_db()
    assert job.status == "pausing"
    assert "Cannot resume" in resp.content.decode()
    assert client.post(f"/jobs/{job.pk}/cancel").status_code == 302
    job.refresh_from_db()
    assert job.status == "cancelled"
    assert Event.objects.filter(job=job, kind="status", payload__to="cancelled").exists()
    assert client.post(f"/jobs/{job.pk}/explode").status_code == 404
    assert client.get(f"/jobs/{job.pk}/cancel").status_code == 405


@pytest.mark.django_db(transaction=True)
def test_drain_pool(client, staff_user, alice, job_factory, fleet):
    job_factory(alice)
    client.force_login(staff_user)
    resp = client.post("/fleet/h100-east/drain", {"state": "draining", "next": "/fleet/"})
    assert resp.status_code == 302 and resp["Location"] == "/fleet/"
    fleet["h100-east"].refresh_from_db()
    assert fleet["h100-east"].state == "draining"
    assert Event.objects.filter(pool=fleet["h100-east"], kind="drained").exists()
    assert "Draining" in client.get("/fleet/").content.decode()
    client.post("/fleet/h100-east/drain", {"state": "active", "next": "//evil.example/"})
    fleet["h100-east"].refresh_from_db()
    assert fleet["h100-east"].state == "active"
    client.post("/fleet/h100-east/drain", {"state": "disabled"})
    fleet["h100-east"].refresh_from_db()
    assert fleet["h100-east"].state == "active"
