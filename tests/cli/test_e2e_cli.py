"""The CI use case end to end: `diloco jobs submit examples/job.yaml --wait` against the real runtime
(daphne + pool workers + coordinator + beat as processes, tests/support/stack.py), exit 0,
then the final checkpoint downloads through the real server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.api.models import ApiToken
from apps.jobs.models import Checkpoint, Job

ROOT = Path(__file__).resolve().parents[2]

SERVICES = bool(os.environ.get("REDIS_URL")) and "postgres" in os.environ.get("DATABASE_URL", "")
NEEDS = "the live stack needs PostgreSQL (DATABASE_URL) and Redis (REDIS_URL)"
pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not SERVICES,
                       reason=NEEDS),
]


@pytest.fixture
def stack(transactional_db, tmp_path):
    from tests.support.stack import Stack

    with Stack(tmp_path, pools={"alpha": 2, "beta": 2}) as s:
        yield s


def diloco(*args, env, timeout=300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "diloco"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "diloco_cli"]
    return subprocess.run([*cmd, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_submit_wait_to_completion(stack, alice, tmp_path):
    env = {**os.environ, "DILOCO_URL": stack.web_url, "DILOCO_TOKEN": ApiToken.issue(alice, "ci")[1],
           "DILOCO_CONFIG": str(tmp_path / "cfg.json")}
    proc = diloco("jobs", "submit", ROOT / "examples" / "job.yaml", "--wait", "--timeout", "240", "--json",
                  "--idempotency-key", "e2e-build-1", env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    body = json.loads(proc.stdout)
    job = Job.objects.get(pk=body["id"])
    print(f"\njob #{job.pk}: {job.status}, outer steps {job.outer_steps}, "
          f"val loss {job.initial_val_loss} -> {job.final_val_loss}, {job.finished_at - job.created_at}")
    assert body["status"] == "completed" and body["exit_code"] == 0
    assert body["final_val_loss"] is not None and body["final_val_loss"] == pytest.approx(job.final_val_loss)
    assert body["tokens_computed"] > 0
    # the CI gate of docs/ci-pipeline.md: the final validation loss is below the initial one
    assert job.final_val_loss < job.initial_val_loss
    # the final checkpoint comes back through the real server, checksum verified
    final = Checkpoint.objects.filter(job=job, kind=Checkpoint.Kind.FINAL).first()
    assert final is not None
    proc = diloco("checkpoints", "download", final.pk, "-o", tmp_path, "--json", env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["sha256"] == final.sha256 and Path(got["path"]).stat().st_size == final.size_bytes
