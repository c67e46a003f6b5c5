"""`manage.py chaos_drill --quick` in the suite: zero duplicates, job completed, loss near baseline."""
from __future__ import annotations

import json

import pytest
from django.core.management import call_command

from .conftest import needs_services

pytestmark = [needs_services, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_chaos_drill_quick(tmp_path, capsys):
    out = tmp_path / "drill.json"
    call_command("chaos_drill", "--quick", "--json", str(out), "--tmp", str(tmp_path / "drill"))
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "spec"}, indent=1))
    assert report["baseline"]["status"] == "completed"
    assert report["baseline"]["final_val_loss"] < report["baseline"]["initial_val_loss"] - 0.1
    assert report["status"] == "completed"
    assert report["duplicates_applied"] == 0
    assert report["baseline"]["duplicates_applied"] == 0
    # The failures must not cost more than 5% of final loss. A ~12 s syncer outage (coordinator
    # kill, then Redis down) in a 2-learner tiny job moves the result by several percent either
    # way (measured -5% and -7% on a quiet machine: the long local stretch helped); a drill that
    # came out *better* than the failure-free run is not a recovery failure.
    assert report["val_loss_rel_diff"] <= 0.05
    assert abs(report["val_loss_rel_diff"]) <= 0.15  # same job and data: never far apart
    kinds = [i["kind"] for i in report["incidents"]]
    assert "learner_lost" in kinds and "syncer_lost" in kinds
    assert all(i["time_to_heal_s"] is not None for i in report["incidents"])
    assert report["syncer_restarts"] >= 1
