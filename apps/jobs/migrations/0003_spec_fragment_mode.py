"""Jobs stored before `fragment_mode` was a spec field ran with strided fragments; the default is
now balanced. Writing the old value into their specs keeps a resumed job's fragments (and its
checkpoints) as they were."""

from django.db import migrations


def keep_strided(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.exclude(spec__has_key="fragment_mode").only("id", "spec").iterator():
        if isinstance(job.spec, dict):
            job.spec = {**job.spec, "fragment_mode": "strided"}
            job.save(update_fields=["spec"])


class Migration(migrations.Migration):

    dependencies = [("jobs", "0002_job_list_index")]

    operations = [migrations.RunPython(keep_strided, migrations.RunPython.noop)]
