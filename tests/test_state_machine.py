import pytest

from apps.jobs import state as st
from apps.jobs.models import Event, Job


def test_every_status_has_a_rule():
    assert set(st.TRANSITIONS) == set(st.STATUSES)


# The allowed moves written out here, not read from the table under test (docs/runtime.md's
# state diagram): a change to TRANSITIONS must change this list too.
ALLOWED = {
    ("queued", "placing"), ("queued", "cancelled"), ("queued", "failed"),
    ("placing", "running"), ("placing", "queued"), ("placing", "cancelled"), ("placing", "failed"),
    ("running", "pausing"), ("running", "completed"), ("running", "failed"), ("running", "cancelled"),
    ("running", "placing"),
    ("pausing", "paused"), ("pausing", "cancelled"), ("pausing", "failed"),
    ("paused", "placing"), ("paused", "cancelled"),
}
ALL_STATUSES = ("queued", "placing", "running", "pausing", "paused", "completed", "failed", "cancelled")


def test_the_statuses_are_the_documented_ones():
    assert st.STATUSES == ALL_STATUSES
    assert {"completed", "failed", "cancelled"} == st.TERMINAL


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in ALL_STATUSES for d in ALL_STATUSES])
def test_check_transition_matrix(src, dst):
    if (src, dst) in ALLOWED:
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
