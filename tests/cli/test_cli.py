"""`diloco` against a live server: exit codes 0/1/2/3/4, --json output, every command."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.api.models import ApiToken
from apps.inventory.models import AcceleratorType, Pool
from apps.jobs.models import Checkpoint, Event, Job, Learner, MetricPoint

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "job.yaml"


@pytest.fixture
def fleet(db):
    cpu = AcceleratorType.objects.create(slug="cli-cpu", vendor="T", model="CPU", kind="cpu", generation="x",
                                         year=2024, memory_gib=16, peak_bf16_tflops=1.0, tdp_watts=100)
    return [Pool.objects.create(slug=f"cli-{i}", name=f"P{i}", region="r", accelerator=cpu, device_count=4,
                                cost_per_device_hour="1", link_gbps=10) for i in range(2)]


def _job(owner, status, **kw) -> Job:
    return Job.objects.create(owner=owner, name="j", spec={"learners": 1, "steps": 10, "batch_size": 4,
                                                           "seq_len": 8}, status=status, **kw)


def test_login_saves_a_token(live_server, alice, tmp_path):
    from .conftest import Cli

    cli = Cli(live_server.url, None)
    r = cli("login", "--username", "alice", "--password", "pw-alice-123", token=None)
    assert r.exit_code == 0, r.stderr
    saved = json.loads(Path(os.environ["DILOCO_CONFIG"]).read_text())
    assert saved["url"] == live_server.url and saved["token"].startswith("dl_")
    assert oct(Path(os.environ["DILOCO_CONFIG"]).stat().st_mode & 0o777) == "0o600"
    assert ApiToken.objects.filter(user=alice, revoked_at__isnull=True).count() == 1
    # later commands use the saved login: no env needed
    code, me = Cli(live_server.url, None).json("whoami", token=None, env={"DILOCO_URL": ""})
    assert code == 0 and me["username"] == "alice"


def test_auth_errors_exit_4(live_server, alice, cli):
    r = cli("login", "--username", "alice", "--password", "wrong", token=None)
    assert r.exit_code == 4 and "Unable to sign in" in r.stderr
    code, body = cli.json("jobs", "list", token="dl_not-a-real-token")
    assert code == 4 and body["exit_code"] == 4 and body["errors"]["detail"]
    r = cli("jobs", "submit", str(EXAMPLE), token="dl_not-a-real-token")
    assert r.exit_code == 4
    r = cli("fleet", token="")
    assert r.exit_code == 4 and "no API token" in r.stderr


def test_invalid_spec_exits_2(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nlearners: 0\ncompression: zip\n")
    code, body = cli.json("jobs", "submit", bad)
    assert code == 2
    assert set(body["errors"]) == {"spec.learners", "spec.compression"}
    r = cli("jobs", "submit", bad, "--wait")
    assert r.exit_code == 2 and "spec.learners" in r.stderr
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    assert cli("jobs", "submit", tmp_path / "broken.yaml").exit_code == 2
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    code, body = cli.json("jobs", "submit", tmp_path / "list.yaml")
    assert code == 2 and "mapping" in body["detail"]
    assert cli("jobs", "submit", tmp_path / "missing.yaml").exit_code == 2
    assert Job.objects.count() == 0


def test_dry_run(cli, fleet):
    code, body = cli.json("jobs", "submit", EXAMPLE, "--dry-run")
    assert code == 0 and body["valid"] is True
    assert body["spec"]["name"] == "demo tiny-gpt"
    assert len(body["placement"]["learners"]) == 3 and body["placement"]["estimate"]["time_s"] > 0
    r = cli("jobs", "submit", EXAMPLE, "--dry-run")
    assert r.exit_code == 0 and "Placement" in r.stdout and "estimate" in r.stdout
    assert Job.objects.count() == 0


def test_submit_with_overrides_and_idempotency(cli, alice):
    code, job = cli.json("jobs", "submit", EXAMPLE, "--set", "steps=7", "--set", "name=ci 42",
                         "--idempotency-key", "build-42")
    assert code == 0 and job["spec"]["steps"] == 7 and job["name"] == "ci 42" and job["status"] == "queued"
    code, again = cli.json("jobs", "submit", EXAMPLE, "--set", "steps=7", "--set", "name=ci 42",
                           env={"DILOCO_IDEMPOTENCY_KEY": "build-42"})
    assert code == 0 and again["id"] == job["id"]
    assert Job.objects.filter(owner=alice).count() == 1


def test_wait_timeout_exits_3(cli):
    # no coordinator runs in this test: the job stays queued and --wait must give up
    code, body = cli.json("jobs", "submit", EXAMPLE, "--wait", "--timeout", "1.5", "--poll", "0.2")
    assert code == 3 and body["timed_out"] is True and body["status"] in ("queued", "placing")
    assert Job.objects.get(pk=body["id"]).status not in ("cancelled", "failed")  # the job is left running
    r = cli("jobs", "wait", body["id"], "--timeout", "0.5", "--poll", "0.2")
    assert r.exit_code == 3 and "timeout" in r.stderr


def test_wait_exit_codes_follow_the_job(cli, alice):
    done = _job(alice, "completed", final_val_loss=1.23, tokens_computed=320)
    failed = _job(alice, "failed", status_reason="learner crashed")
    cancelled = _job(alice, "cancelled")
    code, body = cli.json("jobs", "wait", done.pk)
    assert code == 0 and body["final_val_loss"] == 1.23 and body["progress"] == 1.0
    assert cli("jobs", "wait", failed.pk).exit_code == 1
    assert cli("jobs", "wait", cancelled.pk).exit_code == 1
    r = cli("jobs", "wait", done.pk)
    assert r.exit_code == 0 and "completed" in r.stdout and "1.2300" in r.stdout


def test_status_logs_metrics_cancel(cli, alice, bob):
    job = _job(alice, "running")
    lr = Learner.objects.create(job=job, index=0, state="running")
    Event.objects.create(job=job, kind="placed", message="learner 0 on cli-0")
    Event.objects.create(job=job, kind="merged", message="fragment 0 v1")
    MetricPoint.objects.bulk_create([MetricPoint(job=job, name="train_loss", step=i, value=5 - i / 100)
                                     for i in range(300)])
    MetricPoint.objects.create(job=job, learner=lr, name="tokens_per_s", step=1, value=999.0)
    code, st = cli.json("jobs", "status", job.pk)
    assert code == 0 and st["status"] == "running" and st["latest"]["train_loss"] == pytest.approx(2.01)
    r = cli("jobs", "logs", job.pk)
    assert r.exit_code == 0 and "learner 0 on cli-0" in r.stdout and "fragment 0 v1" in r.stdout
    lines = cli("jobs", "logs", job.pk, "--json").stdout.strip().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["placed", "merged"]
    code, m = cli.json("jobs", "metrics", job.pk, "--points", "30")
    assert code == 0 and len(m["series"]) == 1 and len(m["series"][0]["points"]) == 30
    code, m = cli.json("jobs", "metrics", job.pk, "--learner", "0")
    assert [s["name"] for s in m["series"]] == ["tokens_per_s"]
    assert "train_loss" in cli("jobs", "metrics", job.pk).stdout
    code, listed = cli.json("jobs", "list", "--status", "running")
    assert code == 0 and [j["id"] for j in listed["results"]] == [job.pk]
    code, c = cli.json("jobs", "cancel", job.pk)
    assert code == 0 and c["status"] == "cancelled"
    code, again = cli.json("jobs", "cancel", job.pk)
    assert code == 1 and "terminal" in again["detail"]
    # someone else's job: not found
    other = _job(bob, "running")
    code, body = cli.json("jobs", "status", other.pk)
    assert code == 1 and body["detail"] == "Not found."


def test_fleet(cli, fleet):
    code, body = cli.json("fleet")
    assert code == 0 and [p["slug"] for p in body["pools"]] == ["cli-0", "cli-1"]
    r = cli("fleet")
    assert r.exit_code == 0 and "cli-0" in r.stdout and "Fleet" in r.stdout


def test_checkpoint_download(cli, alice, settings, tmp_path):
    transport = pytest.importorskip("trainer.transport")
    settings.BLOB_STORE_URL = f"file://{tmp_path / 'blobs'}"
    blob = os.urandom(300_000)
    transport.open_store(settings.BLOB_STORE_URL).put("ckpt/j/00001", blob)
    job = _job(alice, "completed")
    ck = Checkpoint.objects.create(job=job, version=1, kind="final", blob_uri="ckpt/j/00001",
                                   size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    code, rows = cli.json("checkpoints", "list", job.pk)
    assert code == 0 and [r["id"] for r in rows] == [ck.pk]
    dest = tmp_path / "out"
    dest.mkdir()
    code, body = cli.json("checkpoints", "download", ck.pk, "-o", dest)
    assert code == 0, body
    path = Path(body["path"])
    assert path.parent == dest and path.read_bytes() == blob and body["sha256"] == ck.sha256
    # a corrupted blob is refused and nothing is left behind
    Checkpoint.objects.filter(pk=ck.pk).update(sha256="0" * 64)
    code, body = cli.json("checkpoints", "download", ck.pk, "-o", tmp_path / "bad.safetensors")
    assert code == 5 and "checksum mismatch" in body["detail"]
    assert not (tmp_path / "bad.safetensors").exists() and not list(tmp_path.glob("*.part"))


def test_server_unreachable_exits_5(alice):
    from .conftest import Cli

    code, body = Cli("http://127.0.0.1:9", "dl_x").json("jobs", "list")
    assert code == 5 and "cannot reach" in body["detail"]


def test_installed_console_script(cli):
    """The `diloco` entry point installed with the project, as a CI job would run it."""
    exe = Path(sys.executable).parent / "diloco"
    if not exe.exists():
        pytest.skip("console script not installed (pip install -e .)")
    env = {**os.environ, "DILOCO_URL": cli.url, "DILOCO_TOKEN": cli.token}
    proc = subprocess.run([str(exe), "jobs", "submit", str(EXAMPLE), "--json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "queued"
    proc = subprocess.run([str(exe), "jobs", "list", "--json"], env={**env, "DILOCO_TOKEN": "dl_bad"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4


def test_api_bench_smoke(live_server, tmp_path):
    """The bench command runs end to end (tiny sizes) against a live server and writes its JSON."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    out = tmp_path / "bench.json"
    call_command("api_bench", "--jobs", "3", "--points", "600", "--clients", "2", "--requests", "2",
                 "--url", live_server.url, "--json", str(out))
    report = json.loads(out.read_text())
    assert set(report["endpoints"]) == {"job list", "job detail", "metrics"}
    for r in report["endpoints"].values():
        assert r["requests"] == 4 and r["errors"] == 0 and r["p95_ms"] >= r["p50_ms"] > 0
    assert not get_user_model().objects.filter(username__startswith="bench-").exists()  # cleaned up
    assert not Job.objects.exists()


def test_wait_shows_progress_then_exits_0(cli, alice):
    """--wait follows a job that moves: the bar shows tokens against the budget and the loss."""
    import threading
    import time

    job = _job(alice, "running")  # budget: 1 learner x 10 steps x 4 x 8 = 320 tokens
    MetricPoint.objects.create(job=job, name="train_loss", step=100, value=2.345)

    def finish():
        time.sleep(0.8)
        Job.objects.filter(pk=job.pk).update(tokens_computed=160)
        time.sleep(0.8)
        Job.objects.filter(pk=job.pk).update(tokens_computed=320, status="completed", final_val_loss=2.2)

    th = threading.Thread(target=finish)
    th.start()
    try:
        r = cli("jobs", "wait", job.pk, "--poll", "0.2", "--timeout", "30")
    finally:
        th.join()
    assert r.exit_code == 0, r.stderr
    assert "320/320 tok" in r.stderr and "loss 2.345" in r.stderr and f"#{job.pk}" in r.stderr
    assert "2.2000" in r.stdout  # the final table on stdout


def test_logs_follow_until_the_end_and_pause_resume(cli, alice):
    import threading
    import time

    job = _job(alice, "running")
    Event.objects.create(job=job, kind="placed", message="first")

    def later():
        time.sleep(0.8)
        Event.objects.create(job=job, kind="merged", message="second")
        time.sleep(0.5)
        Job.objects.filter(pk=job.pk).update(status="completed")
        Event.objects.create(job=job, kind="status", message="running → completed")

    th = threading.Thread(target=later)
    th.start()
    try:
        r = cli("jobs", "logs", job.pk, "--follow", "--poll", "0.2")
    finally:
        th.join()
    assert r.exit_code == 0
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert ["first" in lines[0], "second" in lines[1]] == [True, True]
    assert "running → completed" in lines[-1]  # written as the job ended, still shown

    other = _job(alice, "running")
    code, body = cli.json("jobs", "pause", other.pk)
    assert code == 0 and body["status"] == "pausing"
    code, body = cli.json("jobs", "resume", other.pk)
    assert code == 1 and "paused" in body["detail"]  # only a paused job resumes
    Job.objects.filter(pk=other.pk).update(status="paused")
    code, body = cli.json("jobs", "resume", other.pk)
    assert code == 0 and body["status"] == "placing"


def test_team_submit_and_whoami(cli, alice):
    from django.contrib.auth.models import Group

    code, body = cli.json("jobs", "submit", EXAMPLE, "--team", "vision", "--dry-run")
    assert code == 2 and "no team 'vision'" in body["errors"]["team"][0]
    alice.groups.add(Group.objects.create(name="vision"))
    r = cli("whoami")
    assert r.exit_code == 0 and "teams: vision" in r.stdout
    code, job = cli.json("jobs", "submit", EXAMPLE, "--team", "vision")
    assert code == 0 and job["team"] == "vision"
