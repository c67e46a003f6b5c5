"""A job's file selection on a pool worker or the coordinator ends when the job does (issue 35:
"Cancel does not interrupt it"): apps.coordinator.common.corpus asks the job's status."""
from __future__ import annotations

import pytest

from apps.coordinator import common
from apps.jobs import state as st
from apps.jobs.models import Job
from trainer.data import SelectionLimit

pytestmark = pytest.mark.django_db


@pytest.fixture
def tree(tmp_path, settings):
    root = tmp_path / "data"
    for i in range(40):
        folder = root / f"d{i:02d}"
        folder.mkdir(parents=True)
        for j in range(20):
            (folder / f"f{j:02d}.txt").write_text(f"text {i} {j}\n" * 20)
    settings.DATA_ROOTS = [root.resolve()]
    common._CORPORA.clear()
    yield root
    common._CORPORA.clear()


def _job(owner, status):
    return Job.objects.create(owner=owner, name="c", spec={"name": "c"}, status=status)


@pytest.mark.parametrize("status", [st.CANCELLED, st.PAUSING, st.FAILED])
def test_the_selection_stops_when_the_job_is_gone(alice, tree, tmp_path, status):
    job = _job(alice, status)
    with pytest.raises(SelectionLimit, match="cancelled"):
        common.corpus(f"{tree}/**/*.txt", str(tmp_path / "cache"), job.pk)
    assert not common._CORPORA  # a failure is not kept


def test_a_running_job_loads_its_corpus_once(alice, tree, tmp_path):
    job = _job(alice, st.RUNNING)
    data = common.corpus(f"{tree}/**/*.txt", str(tmp_path / "cache"), job.pk)
    assert data.files == 800
    Job.objects.filter(pk=job.pk).update(status=st.CANCELLED)
    assert common.corpus(f"{tree}/**/*.txt", str(tmp_path / "cache"), job.pk) is data  # cached
