import pytest

from apps.jobs import state as st
from apps.jobs.models import Event, Job


def test_every_status_has_a_rule():
    assert set(st.TRANSITIONS) == set(st.STATUSES)


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in st.STATUSES for d in st.STATUSES])
def test_check_transition_matrix(src, dst):
    if dst in st.TRANSITIONS[src]:
        st.check_transition(src, dst)
    else:
        with pytest.raises(st.IllegalTransition, match=f"cannot go from '{src}' to '{dst}'"):
            st.check_transition(src, dst)


@pytest.mark.django_db
def test_job_transition_records_event_and_timestamps(alice):
    job = Job.objects.create(owner=alice, name="j", spec={})
    job.transition(st.PLACING)
    job.transition(st.RUNNING)
    assert job.started_at is not None
    job.transition(st.COMPLETED, "budget reached")
    job.refresh_from_db()
    assert job.status == st.COMPLETED and job.finished_at is not None
    assert Event.objects.filter(job=job, kind="status").count() == 3
    with pytest.raises(st.IllegalTransition):
        job.transition(st.RUNNING)
    job.refresh_from_db()
    assert job.status == st.COMPLETED
