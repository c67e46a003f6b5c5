"""Jobs stored before `final_average` was a spec field ended on one more outer step; it is now on
by default (the run's last merges make the global the plain mean of the learners' models).
Writing false into their specs keeps a resumed job's last merges as they were."""

from django.db import migrations


def keep_outer_step(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.exclude(spec__has_key="final_average").only("id", "spec").iterator():
        if isinstance(job.spec, dict):
            job.spec = {**job.spec, "final_average": False}
            job.save(update_fields=["spec"])


class Migration(migrations.Migration):

    dependencies = [("jobs", "0004_spec_outer_momentum_decay")]

    operations = [migrations.RunPython(keep_outer_step, migrations.RunPython.noop)]
