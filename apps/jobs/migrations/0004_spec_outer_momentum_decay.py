"""Jobs stored before `outer_momentum_decay` was a spec field ran with the outer momentum held to
the end; unnamed, it now falls to 0 over the last outer steps (a sixth of them). Writing 0 into their
specs keeps a resumed job's outer steps as they were."""

from django.db import migrations


def keep_momentum(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.exclude(spec__has_key="outer_momentum_decay").only("id", "spec").iterator():
        if isinstance(job.spec, dict):
            job.spec = {**job.spec, "outer_momentum_decay": 0}
            job.save(update_fields=["spec"])


class Migration(migrations.Migration):

    dependencies = [("jobs", "0003_spec_fragment_mode")]

    operations = [migrations.RunPython(keep_momentum, migrations.RunPython.noop)]
