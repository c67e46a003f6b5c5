"""Issue 18's high holes: user-named code, data outside the data roots, hostile spec fields.

Each of these failed before the fix: `os:abort` was accepted as a model (and called during
placement), and `"<data root>/,/etc/passwd"` was accepted as a dataset.
"""
from __future__ import annotations

import os

import pytest

from apps.jobs.models import Job
from apps.jobs.spec import SpecError, validate_spec
from trainer.data import resolve_files

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
DRY = "/api/v1/jobs/dry-run/"
TRIPWIRE = "tests.support.tripwire:build"


@pytest.mark.parametrize("model", ["os:abort", "os:system", "subprocess:Popen", "builtins:exec",
                                   "pdb:set_trace", "tempfile:mkdtemp", TRIPWIRE])
@pytest.mark.parametrize("url", [JOBS, DRY])
def test_model_factory_outside_the_allow_list_is_400(as_alice, pool_a, tripwire, url, model):
    r = as_alice.post(url, {"spec": {"name": "h", "model": model}}, format="json")
    assert r.status_code == 400, r.content[:300]
    assert "MODEL_FACTORIES" in r.json()["errors"]["spec.model"][0]
    assert Job.objects.count() == 0
    assert not tripwire.exists(), "the platform imported a user-named module"


def test_allowed_factory_is_accepted(as_alice, pool_a, settings, tripwire):
    settings.MODEL_FACTORIES = ["trainer.models:nope_not_this_one", "tests.support.other:f"]
    r = as_alice.post(DRY, {"spec": {"name": "h", "model": TRIPWIRE}}, format="json")
    assert r.status_code == 400  # not on the list
    settings.MODEL_FACTORIES = [TRIPWIRE]
    spec = validate_spec({"model": TRIPWIRE})
    assert spec.model == TRIPWIRE


def test_presets_are_always_allowed(settings):
    settings.MODEL_FACTORIES = []
    for preset in ("tiny", "small", "base"):
        assert validate_spec({"model": preset}).model == preset


@pytest.fixture
def data_root(tmp_path, settings):
    root = tmp_path / "data"
    root.mkdir()
    (root / "ok.txt").write_text("hello world " * 50)
    settings.DATA_ROOTS = [root.resolve()]
    return root


@pytest.mark.parametrize("dataset", [
    "{root}/,/etc/passwd",                 # the comma bypass
    "{root}/ok.txt,/proc/self/environ",
    "stdlib,/etc/passwd",
    ["{root}/ok.txt", "/etc/passwd"],      # the list form, checked part by part
    "{root}/../../../etc/passwd",
    "{root}/link-out",                     # a symlink inside the root to a file outside
    "{root}/dir-out/passwd",               # through a symlinked folder
    "/etc/*",
    "{root}/../*",
    "ok.txt",                              # relative: depends on the reader's folder
    "{root}/ok.txt\n/etc/passwd",
])
def test_dataset_outside_the_data_roots_is_400(as_alice, data_root, dataset):
    (data_root / "link-out").symlink_to("/etc/passwd")
    (data_root / "dir-out").symlink_to("/etc")
    value = [d.format(root=data_root) for d in dataset] if isinstance(dataset, list) \
        else dataset.format(root=data_root)
    r = as_alice.post(JOBS, {"spec": {"name": "h", "dataset": value}}, format="json")
    assert r.status_code == 400, (value, r.content[:300])
    assert "spec.dataset" in r.json()["errors"]
    assert Job.objects.count() == 0


def test_dataset_inside_the_root_as_a_list(as_alice, data_root, pool_a):
    (data_root / "b.txt").write_text("more text " * 50)
    value = [str(data_root / "ok.txt"), str(data_root / "b.txt"), "stdlib"]
    spec = validate_spec({"dataset": value})
    assert spec.dataset == ",".join(value)  # the engine's own form, split the same way
    with pytest.raises(SpecError):
        validate_spec({"dataset": [str(data_root / "a,b.txt")]})


def test_engine_refuses_files_behind_links_when_given_roots(data_root):
    """What the worker reads is checked again, file by file: a folder of the root whose files
    are links to elsewhere (made after validation) yields nothing outside the root."""
    inner = data_root / "corpus"
    inner.mkdir()
    (inner / "a.txt").write_text("fine " * 20)
    (inner / "b.txt").symlink_to("/etc/passwd")
    with pytest.raises(ValueError, match="outside the data roots"):
        resolve_files(str(inner), roots=[data_root.resolve()])
    assert len(resolve_files(str(inner))) == 2  # the engine's own CLI reads what its user names
    assert resolve_files(f"{inner}/a.txt,stdlib", roots=[data_root.resolve()])


HOSTILE = [
    "../../../../etc/passwd", "/etc/passwd", "/proc/self/environ", "os:abort", "os:system",
    "subprocess:Popen", "builtins:exec", "pdb:set_trace", TRIPWIRE, "x" * 100_000, "\x00\x01\x1b[31m",
    "a\nb\rc\td", "${SECRET_KEY}", "{{ settings.SECRET_KEY }}", "<script>alert(1)</script>",
    "'; DROP TABLE jobs_job; --", "file:///etc/passwd", "s3://other-tenant/bucket", "\u202e\u200b",
    "127.0.0.1:6379", "data/,/etc/passwd",
]


def _fields():
    from trainer.spec import JobSpec

    return list(JobSpec.model_fields)


@pytest.mark.parametrize("field", _fields())
def test_every_field_with_hostile_strings_is_400_or_inert(as_alice, pool_a, tripwire, field):
    """Every spec field, every hostile string: a 400, or stored as inert text that names no code
    or file; nothing imported, nothing harmed."""
    from apps.coordinator.control import watchdog

    pid = os.getpid()
    for value in HOSTILE:
        for url in (DRY, JOBS):
            r = as_alice.post(url, {"spec": {"name": "h", field: value}}, format="json")
            assert r.status_code in (200, 201, 400), (field, value[:40], r.status_code, r.content[:200])
            if r.status_code in (200, 201):
                assert field in ("name",), (field, value[:40])  # only free text may pass
    watchdog()
    assert os.getpid() == pid
    assert not tripwire.exists()
