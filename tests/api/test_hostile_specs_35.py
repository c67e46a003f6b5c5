"""Issue 35: hostile specs refused at submit with a 400 that names the field and the limit:
a dataset glob with repeated `**` (High 1) and `fragments` above the model's tensor count (Low)."""
from __future__ import annotations

import pytest

from apps.jobs.models import Job
from apps.jobs.spec import SpecError, preset_tensors, validate_spec
from trainer.fragments import make_fragments
from trainer.models import build_model

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
SPEC = {"name": "hostile", "learners": 2, "steps": 20, "inner_steps": 5}


@pytest.fixture
def data_root(tmp_path, settings):
    root = tmp_path / "data"
    (root / "corpus" / "a").mkdir(parents=True)
    (root / "corpus" / "a" / "t.txt").write_text("text " * 100)
    settings.DATA_ROOTS = [root.resolve()]
    return root.resolve()


def test_repeated_double_star_glob_is_a_400_naming_the_limit(as_alice, data_root):
    hostile = f"{data_root}/corpus/" + "**/" * 28 + "*.txt"
    r = as_alice.post(JOBS, {"spec": {**SPEC, "dataset": hostile}}, format="json")
    assert r.status_code == 400, r.content
    [msg] = r.json()["errors"]["spec.dataset"]
    assert "at most 2 '**' per pattern" in msg and "has 28" in msg
    assert len(msg) < 200  # the 2000-character pattern is not echoed whole
    # the list form and one part among several are held to the same bound
    r = as_alice.post(JOBS, {"spec": {**SPEC, "dataset": [f"{data_root}/corpus/a/t.txt", hostile]}},
                      format="json")
    assert r.status_code == 400 and "per pattern" in r.json()["errors"]["spec.dataset"][0]
    r = as_alice.post(JOBS, {"spec": {**SPEC, "dataset": f"{data_root}/corpus/**/**/**/*.txt"}},
                      format="json")
    assert r.status_code == 400 and "has 3" in r.json()["errors"]["spec.dataset"][0]
    assert Job.objects.count() == 0


def test_too_many_sources_is_a_400(as_alice, data_root):
    many = ",".join("/d/x" for _ in range(65))
    r = as_alice.post(JOBS, {"spec": {**SPEC, "dataset": many}}, format="json")
    assert r.status_code == 400 and "at most 64 sources" in r.json()["errors"]["spec.dataset"][0]


def test_a_normal_glob_is_accepted(as_alice, data_root):
    for dataset in (f"{data_root}/corpus/**/*.txt", f"{data_root}/**/a/**/*.txt"):
        r = as_alice.post(JOBS, {"spec": {**SPEC, "dataset": dataset}}, format="json")
        assert r.status_code == 201, r.content


def test_fragments_above_the_models_tensors_is_a_400(as_alice):
    tiny = len(dict(build_model("tiny").named_parameters()))
    assert preset_tensors("tiny") == tiny == 52
    with pytest.raises(ValueError, match="parameter tensors"):
        make_fragments(build_model("tiny"), tiny + 1)  # what the syncer met at start, in a loop
    r = as_alice.post(JOBS, {"spec": {**SPEC, "model": "tiny", "inner_steps": 100, "fragments": 60}},
                      format="json")
    assert r.status_code == 400, r.content
    assert list(r.json()["errors"]) == ["spec.fragments"]
    assert "tiny: 52" in r.json()["errors"]["spec.fragments"][0]
    r = as_alice.post(JOBS, {"spec": {**SPEC, "model": "tiny", "inner_steps": 100, "fragments": 52}},
                      format="json")
    assert r.status_code == 201, r.content
    # small and base have more tensors than the spec's 64 fragments allow
    assert preset_tensors("small") >= 64 and preset_tensors("base") >= 64


def test_stored_spec_with_too_many_fragments_fails_validation_again():
    """A job stored before the rule is refused when the coordinator validates it again
    (apps.coordinator.common.job_spec), not started into a syncer crash loop."""
    with pytest.raises(SpecError) as exc:
        validate_spec({**SPEC, "inner_steps": 100, "fragments": 64}, fleet=False)
    assert "fragments" in exc.value.errors
